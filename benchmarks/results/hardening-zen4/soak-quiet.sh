#!/bin/bash
# The same 10-minute hostile soak (soak.sh) on a quiet machine, under `flock -x`, on main
# (third session, 2026-12-07 01:05-01:16 UTC): the client waits 30 s at most for its clients'
# last requests, then prints its tally (benchmarks/results/hardening-zen4/quiet-soak/).
HERE=/work/main OUT=/work/main/benchmarks/results/hardening-zen4/quiet-soak SOAK_EXTRA="--grace 30" \
    exec "$(dirname "$0")/soak.sh"
