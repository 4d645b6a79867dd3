#!/bin/bash
# issue 60's lockout check, "after" side only, on main, on a quiet machine (exclusive lock held)
set -u
HERE=/work/main
TINY=/tmp/h2/tiny-model
OUT=/tmp/ab/lockout; mkdir -p $OUT
info() { echo "$(date -u +%FT%TZ) $*" >> $OUT/lockout-info.txt; }
info "$(lscpu | grep 'Model name'), kernel $(uname -r), load $(cat /proc/loadavg), main $(git -C $HERE rev-parse --short HEAD)"
(cd $HERE && exec .venv/bin/python -m specserve serve --model $TINY --draft-model $TINY \
      --served-model-name tiny --dtype float32 --weights bf16 --max-model-len 1024 \
      --max-num-seqs 4 --api-key k --port 18612 --no-access-log) > $OUT/server.log 2>&1 &
SPID=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:18612/health > /dev/null && break; sleep 1; done
info "server up after $i s"
for addr in "" 127.0.0.2; do
  (cd $HERE && .venv/bin/python -m specserve.bench.lockout --url http://127.0.0.1:18612 \
      --api-key k --tokens 900 --repeats 2 --label after${addr:+-other-address} ${addr:+--fresh-address $addr} \
      --out $OUT/lockout.jsonl)
  info "after${addr:+-other-address} done, load $(cat /proc/loadavg)"
done
kill -TERM $SPID; wait $SPID
info end
