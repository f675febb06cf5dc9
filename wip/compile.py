import os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, __import__("os").path.dirname(__file__)); sys.path.insert(0, "/work/main/src")
import triton, triton.language as tl, subprocess, tempfile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import pair_scan
from fastkda.backends.triton import scan as scan16

def comp(fn, names, consts, opts, tag):
    ptr = {"w": "*bf16", "u": "*bf16", "xs": "*fp32", "v": "*bf16", "beta": "*bf16", "qg": "*bf16", "kd": "*bf16",
           "Aqk": "*bf16", "gl": "*fp32", "h0": "*fp32", "ht": "*fp32", "h": "*bf16", "o": "*bf16", "vn": "*bf16",
           "cu_seqlens": "*i32", "chunk_offsets": "*i32", "T": "i32"}
    sig = {n: (ptr[n] if n in ptr else "constexpr") for n in fn.arg_names}
    none = [n for n in ("u", "h0", "ht", "h", "vn", "cu_seqlens", "chunk_offsets") if n in fn.arg_names]
    for n in none: sig[n] = "constexpr"; consts[n] = None
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    k = triton.compile(ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        res = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobj, "-sass", f.name], capture_output=True, text=True).stdout
    open(f"/work/main/.scratch/pair/{tag}.sass", "w").write(sass)
    usage = " ".join(p for l in res.splitlines() if "REG:" in l for p in l.split() if p.startswith(("REG:", "STACK:")))
    print(tag, usage, "smem", k.metadata.shared, "sass lines", sass.count("\n"), "HMMA", sass.count("HMMA"), "BAR", sass.count("BAR.SYNC"))

base = dict(HV=64, K=128, V=128, C=16, BK=128, BV=64, USE_H0=False, STORE_HT=False, V_FIRST=False, IS_VARLEN=False,
            DT=tl.bfloat16, PREC="bf16", EMU=False, U_IN=True, U_PREC="tf32", SIGMOID=True, BETA_SCALE=1.0, A_FULL=True)
#comp(pair_scan.kda_fwd_scan_kernel, None, dict(base), dict(num_warps=4, num_stages=3), "pair_w4")
#comp(pair_scan.kda_fwd_scan_kernel, None, dict(base), dict(num_warps=8, num_stages=3), "pair_w8")
b16 = dict(base, STORE_H=False, STORE_O=True, STORE_VN=False, H_V_FIRST=False)
#comp(scan16.kda_fwd_scan_kernel, None, b16, dict(num_warps=4, num_stages=3), "scan16_w4")
#comp(pair_scan.kda_fwd_scan_kernel, None, dict(base, BV=32), dict(num_warps=4, num_stages=3), "pair_bv32_w4")
#comp(pair_scan.kda_fwd_scan_kernel, None, dict(base, BV=32), dict(num_warps=4, num_stages=2), "pair_bv32_w4_s2")
#comp(scan16.kda_fwd_scan_kernel, None, dict(b16, BV=32), dict(num_warps=4, num_stages=3), "scan16_bv32_w4")
for bv, w, st in ((128, 8, 2), (128, 8, 3)):
    comp(pair_scan.kda_fwd_scan_kernel, None, dict(base, BV=bv), dict(num_warps=w, num_stages=st), f"pair_bv{bv}_w{w}_s{st}")
#comp(scan16.kda_fwd_scan_kernel, None, dict(base, STORE_H=False, STORE_O=True, STORE_VN=False, H_V_FIRST=False),
#     dict(num_warps=4, num_stages=3), "scan16_bv64_w4_s3")
