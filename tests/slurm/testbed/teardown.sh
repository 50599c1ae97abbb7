#!/usr/bin/env bash
# Undo setup.sh (run with the same BASE and TAG): cancel jobs, stop slurmd/slurmctld/munged by pid
# file, kill what is left in our namespaces, delete namespaces, veths, bridge, the iptables rule and
# (unless KEEP_STATE=1) $BASE. Safe to run twice, or after a setup that failed half-way.
set -uo pipefail
t0=$(date +%s.%N)
: "${BASE:?BASE must name the test bed directory}"
TAG=${TAG:-dsl}
BR=${TAG}br
export SLURM_CONF=$BASE/etc/slurm.conf

# Cancel every job and let the queue drain first: TERMing slurmd/slurmctld while jobs are still
# completing made them hang until the KILL fallback.
if [[ -f $SLURM_CONF ]] && [[ -f $BASE/run/slurmctld.pid ]]; then
  jobs=$(timeout 5 squeue -h -o %i 2>/dev/null) && [[ -n $jobs ]] && timeout 5 scancel $jobs 2>/dev/null
  for _ in $(seq 50); do
    [[ -z $(timeout 2 squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.2
  done
fi

stop_pidfiles() {  # TERM all at once (each daemon needs ~1.5-2 s), wait up to 10 s, then KILL
  local f pid pids=()
  for f in "$@"; do
    [[ -f $f ]] && pid=$(cat "$f" 2>/dev/null) && [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
  done
  for _ in $(seq 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    (( alive )) || return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  return 0
}
stop_pidfiles "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid"

ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$TAG-"; }
# whatever still runs inside OUR namespaces is a job of ours (nothing else lives there)
for ns in $(ours); do
  for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
done
stop_pidfiles "$BASE/run/munged.pid"

for ns in $(ours); do ip netns del "$ns"; done
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${TAG}v"); do
  ip link del "$l" 2>/dev/null
done
ip link del "$BR" 2>/dev/null
# iproute2 self-bind-mounts /run/netns; drop it if no namespace is left
if [[ -d /run/netns && -z $(ls -A /run/netns) ]]; then umount /run/netns 2>/dev/null; rmdir /run/netns 2>/dev/null; fi
if command -v iptables >/dev/null; then
  iptables -D FORWARD -i "$BR" -o "$BR" -j ACCEPT 2>/dev/null || true
fi
[[ ${KEEP_STATE:-0} == 1 ]] || rm -rf "$BASE"
echo "teardown done in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
