#!/usr/bin/env bash
# wave 22 call a: the split merge in a cluster of the row's splits. GPU tests (the cluster tests, then the
# whole test_attention_cuda), sanitizers on the cluster tests, then a same-run A/B on the split shapes:
# the new kvq with the merge kernel (KVQ_DECODE_CLUSTER_MERGE=0, new0) and as planned (new), alternating.
set -uo pipefail
cd "$(dirname "$0")/../../.."
R=/tmp/w22a; rm -rf $R; mkdir -p $R /tmp/kvq-bin/lib /tmp/kvq-bin/bin
X() { python3 -c "import lzma,sys; open(sys.argv[2],'wb').write(lzma.open(sys.argv[1]).read())" "$1" "$2"; }
for f in .device/lib/*.xz; do X "$f" /tmp/kvq-bin/lib/$(basename "$f" .xz); done
export LD_LIBRARY_PATH=/tmp/kvq-bin/lib:${LD_LIBRARY_PATH:-}
B=/tmp/kvq-bin/bin
for v in kvq_new test_attention_cuda_new; do X .devbase/$v.xz $B/$v; chmod +x $B/$v; done
S=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee $R/gpu.txt >> $S
timeout 60 $B/test_attention_cuda_new --gtest_filter='*Cluster*:*Timeline*:CudaDecodeApi.*' --gtest_brief=1 > $R/test_cluster.log 2>&1
echo "cluster/api tests rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_cluster.log | tr '\n' ' ')" >> $S
grep -E '^\[  FAILED  \]|Failure|Expected|Which is' $R/test_cluster.log | head -20 >> $S
SH="8,32,8,128,8192;16,8,1,256,8192;8,32,16,128,16384;64,9,3,64,8192;32,32,8,128,4096;8,9,3,64,2048"
bench() {  # variant round
  local v=$1 round=$2 bin=kvq_new env=""
  [[ $v == base ]] && bin=kvq_base
  [[ $v == new0 ]] && env="KVQ_DECODE_CLUSTER_MERGE=0"
  local t0=$SECONDS
  env $env timeout 110 $B/$bin bench decode --backend cuda --kv-cache-dtype bf16,fp8,int8,int4 --block-sizes 16,32 --iters 30 \
    --shapes "$SH" --json $R/${v}_$round.json > $R/${v}_$round.log 2>&1
  echo "== $v round $round rc=$? $((SECONDS - t0)) s" >> $S
}
for v in new0 new; do bench $v 1; done
timeout 80 compute-sanitizer --tool memcheck --error-exitcode 9 $B/test_attention_cuda_new --gtest_filter='*Cluster*' --gtest_brief=1 > $R/sanitizer_memcheck.log 2>&1
echo "sanitizer memcheck (cluster tests) rc=$? $(grep -E 'ERROR SUMMARY|PASSED' $R/sanitizer_memcheck.log | tr '\n' ' ') at $SECONDS s" >> $S
for v in new new0; do (( SECONDS < 400 )) && bench $v 2; done
for v in new0 new; do (( SECONDS < 400 )) && bench $v 3; done
python3 - $R <<'PY' >> $S
import json, sys, collections
R = sys.argv[1]; V = ["new0", "new"]; res = collections.defaultdict(dict); rd = {}; fd = {}
for k in V:
    for r in range(1, 4):
        try: rows = json.load(open(f"{R}/{k}_{r}.json"))["decode"]
        except Exception as e: print(k, r, e); continue
        for row in rows:
            key = (f"B{row['batch']} Hq{row['num_q_heads']} Hkv{row['num_kv_heads']} D{row['head_dim']} L{row['seq_len']}", row["format"], row["block_size"])
            res[key].setdefault(k, []).append(row["us_median"]); rd[key, k] = row.get("frac_of_read", 0)
            fd[key, k] = f"{row['splits']}{'c' if row.get('cluster_merge') else ''}"
print(f"{'shape':28s} {'fmt':9s} bs {'new0 us (rounds)':>24s} {'new us (rounds)':>24s} split new/new0 %read new0/new")
f = lambda xs: "/".join(f"{x:.1f}" for x in xs)
for key, d in res.items():
    if len(d) < 2: continue  # best of the rounds each ran
    n0, n = min(d["new0"]), min(d["new"])
    print(f"{key[0]:28s} {key[1]:9s} {key[2]:2d} {n0:7.1f} ({f(d['new0'])}) {n:7.1f} ({f(d['new'])}) {fd[key,'new']:>4s} {n/n0:6.3f} {100*rd[key,'new0']:5.1f} {100*rd[key,'new']:5.1f}")
PY
left=$(( 570 - SECONDS )); (( left > 30 )) || left=30
timeout $left $B/test_attention_cuda_new --gtest_brief=1 > $R/test_all.log 2>&1
echo "test_attention_cuda rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $R/test_all.log | tr '\n' ' ')" >> $S
grep -E '^\[  FAILED  \]' $R/test_all.log | head -10 >> $S
cd /tmp && tar czf "$OUT/w22a.tgz" w22a && cp $R/summary.txt "$OUT/"
cat $R/summary.txt
