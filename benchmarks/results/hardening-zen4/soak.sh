#!/bin/bash
# The 10-minute hostile soak of issue 60 on this branch: the default pair (qwen2.5-coder-1.5b
# int4 target, 0.5b int4 draft, hybrid speculation), 4 sequence slots, 48 waiting places.
# Clients (specserve/bench/soak.py): 16 well-behaved streaming chats; malformed, oversized and
# deeply nested bodies and disconnects; a slow reader; stalled streams, trickled bodies,
# half-open connections; bursts of 64; a flood of 16 streams never read (1,500 tokens each) +
# 16 endless bodies held 40 s, again and again; 2 agents on /v1/responses and /v1/messages
# with a tool; the tool-call storm (```{ x 250 forced, n = 2); /health every 0.5 s; a fresh
# client from 127.0.0.2 every 10 s. Run on 2026-12-06 under `flock -s` (no exclusive window was
# to be had), load 15-19 from other sessions: see soak-info.txt for how it ended.
set -u
HERE=${HERE:-/work/wt-hardening2}
OUT=${OUT:-/tmp/h2/res}; mkdir -p $OUT
PY=$HERE/.venv/bin/python
info() { echo "$(date -u +%FT%TZ) $*" >> $OUT/soak-info.txt; }
info "$(lscpu | grep 'Model name'), kernel $(uname -r), load $(cat /proc/loadavg)"
cd $HERE
$PY -m specserve serve --api-key k --port 18613 --max-num-seqs 4 --max-waiting 48 \
  --no-access-log > $OUT/soak-server.log 2>&1 &
SPID=$!
for i in $(seq 1 900); do curl -sf http://127.0.0.1:18613/health > /dev/null && break; sleep 1; done
info "server pid $SPID up after $i s"
$PY -m specserve.bench.soak --url http://127.0.0.1:18613 --api-key k --pid $SPID --clients 16 \
  --duration 600 --max-tokens 64 --warmup 60 --flood 16 --flood-tokens 1500 --stall-s 40 \
  --agents 2 --storm-repeats 250 --fresh-address 127.0.0.2 ${SOAK_EXTRA:-} > $OUT/soak.json 2> $OUT/soak.err
info "soak done, load $(cat /proc/loadavg)"
curl -s -H "Authorization: Bearer k" http://127.0.0.1:18613/metrics > $OUT/soak-metrics.txt
kill -TERM $SPID; wait $SPID; info "server exit $?"
