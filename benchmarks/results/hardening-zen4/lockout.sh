#!/bin/bash
# The lockout check of issue 60, before (c000eb9, the code at the session's start, checked out
# at /work/baseline) and after (this branch), on the tests' tiny random qwen2 model (64 wide,
# 2 layers, 112-token vocabulary: tests/tiny.py, `build_hf_model("qwen2", seed=0)`, saved to
# $TINY), itself as its draft, as tests/server/conftest.py serves it; 4 sequence slots,
# everything else default (write timeout 30 s, send buffer 256 KiB); 16 streams never read
# (900 tokens each: the model's context is 1,024) + 16 endless bodies, then a fresh client.
# Run on 2026-12-06 under `flock -s` (no exclusive window was to be had), load 15-19 from other
# sessions' test suites and benchmarks. One repeat each: the second repeats were stopped for
# time (the rows, lost from the unflushed file, are those the script printed: lockout.jsonl).
set -u
HERE=/work/wt-hardening2
TINY=${TINY:-/tmp/h2/tiny-model}
OUT=${OUT:-/tmp/h2/res}; mkdir -p $OUT
info() { echo "$(date -u +%FT%TZ) $*" >> $OUT/lockout-info.txt; }
info "$(lscpu | grep 'Model name'), kernel $(uname -r), load $(cat /proc/loadavg)"
serve() {  # serve <dir> <python> <port> <log>
  (cd $1 && exec $2 -m specserve serve --model $TINY --draft-model $TINY \
      --served-model-name tiny --dtype float32 --weights bf16 --max-model-len 1024 \
      --max-num-seqs 4 --api-key k --port $3 --no-access-log) > $4 2>&1 &
  SPID=$!
  for i in $(seq 1 600); do curl -sf http://127.0.0.1:$3/health > /dev/null && break; sleep 1; done
  info "server $1 pid $SPID up after $i s"
}
check() {  # check <port> <label> <repeats> [fresh address]
  # (run as benchmarks/scripts/lockout_check.py at ba703f9: the same code, moved since)
  (cd $HERE && .venv/bin/python -m specserve.bench.lockout --url http://127.0.0.1:$1 \
      --api-key k --tokens 900 --repeats $3 --label $2 ${4:+--fresh-address $4} \
      --out $OUT/lockout.jsonl)
  info "$2 done, load $(cat /proc/loadavg)"
}
serve /work/baseline /work/main/.venv/bin/python 18611 $OUT/lockout-before-server.log
check 18611 before 1
kill -TERM $SPID; wait $SPID
serve $HERE $HERE/.venv/bin/python 18612 $OUT/lockout-after-server.log
check 18612 after 1
check 18612 after-other-address 1 127.0.0.2
kill -TERM $SPID; wait $SPID
info "end"
