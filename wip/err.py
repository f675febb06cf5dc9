import os, sys, torch
os.environ["FASTKDA_BACKEND"] = "triton"
sys.path.insert(0, "/work/main/.scratch")
from fastkda.testing import Case, make_inputs, reference, rel_rms
from fastkda.backends.triton.plan import tuned
import fastkda
from fastkda.backends.triton import forward
orig = forward.fwd_scan
import pair.pair_scan as ps
def patched(opts, plan, scan, *a):
    return ps.fwd_scan_pairs(opts, plan, scan, *a) if plan.short is not None else orig(opts, plan, scan, *a)
for gate in ("safe", "softplus"):
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        case = Case(T=300, H=2, K=128, V=128, gate=gate, dtype=torch.bfloat16, l2norm=True)
        x = make_inputs(case, device="cpu", generator=g)
        o_ref, s_ref = reference(x)
        res = []
        for name, fn in (("scan16", orig), ("pairs", patched)):
            forward.fwd_scan = fn
            with tuned(short_min_pairs=1), torch.no_grad():
                o, s = fastkda.chunk_kda(**x)
            res.append(f"{name} o {rel_rms(o, o_ref):.3e} S {rel_rms(s, s_ref):.3e}" if s is not None else f"{name} o {rel_rms(o, o_ref):.3e}")
        print(gate, seed, " | ".join(res), flush=True)
