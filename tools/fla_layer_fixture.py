"""Write tests/data/fla_kda_layer.pt: small layers built with fla's ``KimiDeltaAttention``
(flash-linear-attention 0.6.0), their state dicts, inputs and outputs, for tests/test_layer_fla.py.

    pip install --no-deps --target SITE flash-linear-attention==0.6.0 fla-core==0.6.0 einops
    PYTHONPATH=SITE:src python tools/fla_layer_fixture.py [OUTPUT]

What runs, and what the file therefore pins:

- fla's layer as shipped: its projections, short convolution (fla's Triton kernels), gates, gated
  RMSNorm (fla's Triton kernel), output projection, padding removal and cache handling.
- Its KDA operator is NOT fla's kernel: ``chunk_kda`` and ``fused_recurrent_kda`` in fla's layer
  module are replaced by fastkda's float64 per-token reference (``fastkda.naive.naive_recurrent_kda``,
  outputs cast back to float32, states to float32). fla's KDA kernels run on CUDA only; fastkda's
  operators are tested against that reference elsewhere. The fixture tests the layer's wiring.
- Without CUDA, fla's convolution and norm kernels run in Triton's interpreter on CPU
  (``TRITON_INTERPRET=1``, set here before Triton is imported); Triton's autotuner, which times
  kernels and needs a GPU driver for that, is given constant timings, so it takes the first
  configuration (the results do not depend on the choice).

fla's ``fla.layers`` package imports every layer, some of which need ``transformers``; where that
is missing, only ``fla.layers.kda`` and what it imports are loaded. The cache is a minimal object
with the interface fla's layer uses (``len``, ``cache[i]``, ``update(..., layer_idx=i)``).
"""

from __future__ import annotations

import os
import sys
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

OUTPUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "fla_kda_layer.pt")
SEED = 20240601
B, T_PREFILL, STEPS, T_FULL = 3, 9, 2, 12
# name: constructor arguments (fla's names); together they cover GVA, expand_v, the convolution bias,
# the lower-bound (safe) gate, negative eigenvalues, no short convolution and a convolution of width 2
CONFIGS = {
    "gva_expand_v": dict(hidden_size=32, expand_v=2, head_dim=8, num_heads=2, num_v_heads=4, conv_bias=True,
                         layer_idx=0),
    "safe_gate": dict(hidden_size=32, head_dim=8, num_heads=2, safe_gate=True, lower_bound=-5.0,
                      allow_neg_eigval=True, conv_size=2, norm_eps=1e-6, layer_idx=1),
    "no_short_conv": dict(hidden_size=32, head_dim=16, num_heads=2, use_short_conv=False, mode="fused_recurrent",
                          layer_idx=0),
}


class LayerCache:
    """Per-layer state dicts behind fla's layer-cache interface."""

    def __init__(self):
        self.states: list[dict] = []

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def update(self, recurrent_state=None, conv_state=None, layer_idx=0, offset=1, **_):
        while len(self.states) <= layer_idx:
            self.states.append({"recurrent_state": None, "conv_state": None})
        if recurrent_state is not None:
            self.states[layer_idx]["recurrent_state"] = recurrent_state
        if conv_state is not None:
            self.states[layer_idx]["conv_state"] = conv_state
        return self.states[layer_idx]


def import_fla_layer():
    """fla's layer module, with its KDA operators replaced by the float64 reference; and a counter
    of the reference's calls."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        import triton.runtime.autotuner as autotuner

        autotuner.Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
    import fla

    try:
        import fla.layers.kda as fla_kda
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "fla":
            raise
        for name in [m for m in sys.modules if m == "fla.layers" or m.startswith("fla.layers.")]:
            del sys.modules[name]
        package = types.ModuleType("fla.layers")  # the package without its __init__ (which imports every layer)
        package.__path__ = [os.path.join(os.path.dirname(fla.__file__), "layers")]
        sys.modules["fla.layers"] = package
        import fla.layers.kda as fla_kda
    from fastkda.naive import naive_recurrent_kda

    calls = []

    def reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        calls.append(1)
        kw.pop("safe_gate", None)  # a promise to fla's kernels; the reference computes the gate as it is
        o, state = naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, **kw)
        return o.to(q.dtype), None if state is None else state.float()

    fla_kda.chunk_kda = fla_kda.fused_recurrent_kda = reference
    return fla_kda, calls


def make_case(fla_kda, config: dict, device: str) -> dict:
    torch.manual_seed(SEED)
    layer = fla_kda.KimiDeltaAttention(**config).to(device).eval()
    with torch.no_grad():  # move the parameters that start constant away from their start
        layer.o_norm.weight.add_(0.2 * torch.randn_like(layer.o_norm.weight))
        layer.A_log.add_(0.3 * torch.randn_like(layer.A_log))
    x = torch.randn(B, T_FULL, config["hidden_size"], device=device)
    mask = torch.ones(B, T_FULL, dtype=torch.long, device=device)
    mask[0, :3] = 0  # left padding, as batched generation has it; row 1 has none
    mask[2, :5] = 0
    case = {"config": config, "state_dict": {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()},
            "x": x.cpu(), "attention_mask": mask.cpu()}
    with torch.no_grad():
        case["out"] = layer(x)[0].cpu()
        case["out_masked"] = layer(x, attention_mask=mask)[0].cpu()
        for masked in (False, True):
            cache = LayerCache()
            am = mask[:, :T_PREFILL] if masked else None
            outs = [layer(x[:, :T_PREFILL], attention_mask=am, past_key_values=cache, use_cache=True)[0]]
            for t in range(T_PREFILL, T_PREFILL + STEPS):
                am = mask[:, : t + 1] if masked else None
                outs.append(layer(x[:, t: t + 1], attention_mask=am, past_key_values=cache, use_cache=True)[0])
            state = cache[config["layer_idx"]]
            conv = state["conv_state"]
            key = "decode_masked" if masked else "decode"
            case[key] = [o.cpu() for o in outs]
            case[key + "_recurrent_state"] = state["recurrent_state"].cpu().clone()
            case[key + "_conv_state"] = None if conv is None else tuple(c.cpu().clone() for c in conv)
    with torch.enable_grad():  # training: the chunked operator's path of fla's layer
        layer.train()
        case["out_train"] = layer(x)[0].detach().cpu()
    return case


def main(argv: list[str]) -> int:
    output = argv[0] if argv else OUTPUT
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fla_kda, calls = import_fla_layer()
    import fla

    data = {"fla_version": fla.__version__, "prefill": T_PREFILL, "steps": STEPS, "cases": {}}
    for name, config in CONFIGS.items():
        data["cases"][name] = make_case(fla_kda, config, device)
    assert calls, "fla's layer did not call the reference operator"
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    torch.save(data, output)
    print(f"wrote {output} ({os.path.getsize(output)} bytes; fla {fla.__version__}; {len(calls)} reference calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
