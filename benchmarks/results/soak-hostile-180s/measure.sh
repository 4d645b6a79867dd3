#!/bin/bash
# The soak of the brief: the default pair on this machine, 3 minutes calm, then 3 minutes with
# the hostile clients, against one server (nice -n 5 for the server and the clients).
set -u
cd /work/wt/harden
export PYTHONPATH=$PWD
PY=/work/main/.venv/bin/python
KEY=soak-key
PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
OUT=${OUT:-/tmp/soak-hostile}; mkdir -p $OUT
nice -n 5 $PY -m specserve.cli serve --api-key $KEY --port $PORT --max-waiting 16 --no-access-log > $OUT/server.log 2>&1 &
SPID=$!
echo "server pid $SPID port $PORT" > $OUT/info.txt
for i in $(seq 1 600); do
  if curl -sf http://127.0.0.1:$PORT/health > /dev/null; then break; fi; sleep 1
done
echo "up after $i s" >> $OUT/info.txt
uptime >> $OUT/info.txt
nice -n 5 $PY -m specserve.bench.soak --url http://127.0.0.1:$PORT --api-key $KEY --pid $SPID \
  --clients 16 --duration 180 --max-tokens 64 --warmup 45 --calm > $OUT/calm.json 2> $OUT/calm.err
uptime >> $OUT/info.txt
nice -n 5 $PY -m specserve.bench.soak --url http://127.0.0.1:$PORT --api-key $KEY --pid $SPID \
  --clients 16 --duration 180 --max-tokens 64 --warmup 45 > $OUT/hostile.json 2> $OUT/hostile.err
uptime >> $OUT/info.txt
curl -s -H "Authorization: Bearer $KEY" http://127.0.0.1:$PORT/metrics > $OUT/metrics.txt
kill -TERM $SPID; wait $SPID; echo "server exit $?" >> $OUT/info.txt
