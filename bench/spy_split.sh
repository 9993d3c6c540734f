#!/usr/bin/env bash
# A command that starts the scheduler service (bench/throughput.py --mode split ...), with py-spy
# sampling the scheduler's process (the engine core with --api-server-count N) from its start to
# its exit: collapsed stacks per thread in $OUT/core-stacks.txt (py-spy's raw format: one
# "thread;frame;...;frame count" line per stack), the command's output in $OUT/spy-run.log.
#
#   bash bench/spy_split.sh python3 bench/throughput.py --workload w1 --device cuda --mode split --stream-interval 1
#
# py-spy comes from .whl/ on the GPU machine (bench/gpu_run.sh installs it in /tmp/site/bin).
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
"$@" >"$OUT/spy-run.log" 2>&1 &
run=$!
pid=
while kill -0 $run 2>/dev/null && [ -z "$pid" ]; do
    pid=$(pgrep -f -- "-m scheduler_service" | head -1)
    sleep 0.05
done
[ -n "$pid" ] && "${PY_SPY:-py-spy}" record ${SPY_FLAGS:-} --nonblocking --threads -r "${SPY_RATE:-500}" -d 600 -f raw \
    -o "$OUT/core-stacks.txt" --pid "$pid" >"$OUT/spy.log" 2>&1
wait $run
tail -n 6 "$OUT/spy-run.log"
