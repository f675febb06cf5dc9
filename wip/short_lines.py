"""Offline sm_90 compile of the short kernel (bf16, bounded, K = V = 128): SASS instructions per source line."""
import os, sys, json, re, subprocess, tempfile, collections
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "/work/main/src")
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastkda.backends.triton import short

r = None
for l in open("/work/main/.scratch/tscan/l.jsonl"):
    x = json.loads(l)
    c = x["constexprs"]
    if x["name"] == "kda_fwd_short_kernel" and c.get("BOUNDED") and c.get("GATE") == 2 and c.get("L2NORM"):
        r = x; break
fn = short.kda_fwd_short_kernel
bounded = sys.argv[1] == "bounded" if len(sys.argv) > 1 else True
warps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
c = dict(r["constexprs"]); c.update(INV_PREC=os.environ.get('INV', 'ieee'), H=64, HV=64, K=128, V=128, BK=128, BV=128, PREC="bf16", SIGMOID=True, BOUNDED=bounded,
                                    GATE=2 if bounded else 1, FAST=int(os.environ.get("FAST", "2")))
c.pop("X_PREC", None)
if not bounded: c["HAS_A"] = True
sig = {n: r["signature"].get(n, "constexpr") for n in fn.arg_names}
for n in ("q", "k", "v", "g", "beta", "w", "qg", "kd", "Aqk"):
    if sig.get(n, "").startswith("*"): sig[n] = "*bf16"
for n in list(c):
    if c[n] is None: sig[n] = "constexpr"
for n, t in sig.items():
    if t == "constexpr" and n not in c: c[n] = None
consts = {}
for n, v in c.items():
    if isinstance(v, str) and v.startswith("tl:"): v = tl.dtype(v[3:])
    if n in fn.arg_names: consts[(fn.arg_names.index(n),)] = v
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=1))
nvd = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(k.asm["cubin"]); f.flush()
    out = subprocess.run([nvd, "-g", "-c", f.name], capture_output=True, text=True).stdout
cur = "?"
cnt = collections.Counter(); ops = collections.defaultdict(collections.Counter)
for line in out.splitlines():
    m = re.search(r'//## File "([^"]+)", line (\d+)', line)
    if m:
        cur = f"{os.path.basename(m.group(1))}:{m.group(2)}"; continue
    m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
    if m:
        cnt[cur] += 1; ops[cur][m.group(2).split(".")[0]] += 1
tot = sum(cnt.values())
print("total SASS", tot, "regs/spill:", k.n_regs if hasattr(k, "n_regs") else "")
src = {}
for f_ in ("short.py", "tiles.py", "common.py"):
    src[f_] = open(f"/work/main/src/fastkda/backends/triton/{f_}").read().splitlines()
for loc, n in cnt.most_common(30):
    fname, ln = loc.split(":") if ":" in loc else (loc, "0")
    text = src.get(fname, [""] * 10000)[int(ln) - 1].strip()[:80] if fname in src else ""
    print(f"{n:5d} {loc:16s} {dict(ops[loc].most_common(4))}  | {text}")
