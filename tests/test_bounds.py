"""The interpreter tier's bounds check (bounds.py) sees what it is there to see: a load, a store or
an atomic one element past a tensor argument (also past a view into a larger tensor), and nothing
when every address is inside."""

import pytest
import torch
from conftest import BOUNDS_CHECKED

pytestmark = pytest.mark.skipif(not BOUNDS_CHECKED, reason="the interpreter tier's check")


@pytest.mark.parametrize("atomic", [False, True], ids=["store", "atomic"])
def test_reports_one_element_past(atomic):
    import bounds
    from triton_probes import masked_copy_kernel

    base = torch.zeros(8)
    x, y = base[:4], torch.zeros(4)  # x: a view of the first 4 of 8 elements
    masked_copy_kernel[(1,)](x, y, 4, EXTRA=0, ATOMIC=atomic)
    assert bounds.take() == []
    masked_copy_kernel[(1,)](x, y, 4, EXTRA=1, ATOMIC=atomic)
    seen = bounds.take()
    kind = "atomic" if atomic else "store"
    assert seen == [f"masked_copy_kernel: {k} of 1 elements outside its arguments, the first at byte 16 of `{a}` "
                    "(16 bytes)" for k, a in (("load", "x"), (kind, "y"))], seen
    assert bounds.take() == []
