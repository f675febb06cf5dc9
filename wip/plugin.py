"""pytest plugin: the short path's scan replaced by the pair-stepping prototype."""
import sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
import pair_scan
from fastkda.backends.triton import forward

_orig = forward.fwd_scan


def _patched(opts, plan, scan, *a):
    if plan.short is not None:
        open('/tmp/pair_used', 'a').write('x')
        return pair_scan.fwd_scan_pairs(opts, plan, scan, *a)
    return _orig(opts, plan, scan, *a)


forward.fwd_scan = _patched
