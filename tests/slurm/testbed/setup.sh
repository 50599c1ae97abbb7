#!/usr/bin/env bash
# A real multi-node SLURM cluster on ONE Linux machine, for tests/slurm/ (ported from the project's
# test-bed recipe; keep the pitfall notes, each one cost a debugging session).
#   - each compute node = network + UTS + mount namespace: own address, own hostname node1..nodeN
#   - slurmctld in its own namespace; one munged on the host (a filesystem socket every node reaches)
#   - config, state, logs under $BASE; outside it only the namespaces, veths, bridge, daemons and at
#     most one iptables rule: teardown.sh (same environment) removes all of them
# Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and Debian's slurmctld slurmd slurm-client munge.
# Usage: BASE=/some/dir [NNODES=2] [NODE_CPUS=4] [FAKE_GPUS=2] [NET=10.232.8] [TAG=dsl] setup.sh
# Afterwards: export SLURM_CONF=$BASE/etc/slurm.conf ; sinfo ; srun -N2 hostname
set -Eeuo pipefail
trap 'echo "setup.sh: failed at line $LINENO: $BASH_COMMAND (logs: $BASE/log; clean up: teardown.sh)" >&2' ERR
t0=$(date +%s.%N)

: "${BASE:?BASE must name the test bed directory}"
NNODES=${NNODES:-2}
NODE_PREFIX=${NODE_PREFIX:-node}  # node names node1..nodeN -> nodelist "node[1-2]"
NODE_CPUS=${NODE_CPUS:-4}         # CPUs advertised per node (may exceed the real cores)
FAKE_GPUS=${FAKE_GPUS:-0}         # >0: advertise N fake GPUs per node (gres over /dev/null-like devices)
MIN_JOB_AGE=${MIN_JOB_AGE:-4}     # s a finished job stays visible to scontrol/squeue
NET=${NET:-10.232.8}              # the /24 on the private bridge
TAG=${TAG:-dsl}                   # prefix of every namespace/link name: $TAG-<node> netns, ${TAG}v<i>, ${TAG}br
BR=${TAG}br
CTL=slurmctl                      # controller hostname
CONF=$BASE/etc/slurm.conf
MUNGE_SOCK=$BASE/munge/munge.socket.2
export CGROUP_TMPFS=${CGROUP_TMPFS:-1}  # 1: slurmd sees an empty tmpfs at /sys/fs/cgroup (see in_node)

[[ $(id -u) == 0 ]] || { echo "must run as root" >&2; exit 1; }
command -v slurmctld >/dev/null || { echo "install slurmctld slurmd slurm-client munge first" >&2; exit 1; }
(( ${#BR} <= 15 )) || { echo "TAG too long for link names: $TAG" >&2; exit 1; }
if ip link show "$BR" &>/dev/null || ip netns list | grep -q "^$TAG-"; then
  echo "$BR or $TAG-* namespaces exist: run teardown.sh with TAG=$TAG first" >&2; exit 1
fi
(( ${#MUNGE_SOCK} < 100 )) || { echo "BASE too long for a unix socket path: $MUNGE_SOCK" >&2; exit 1; }

mkdir -p "$BASE"/{etc,log,run,state/ctld,spool}
chmod 755 "$BASE" "$BASE"/{etc,log,run,state,spool}

# ---------------------------------------------------------------- munge
# Own key and socket, so a distro munged (started by apt) does not matter.
mkdir -p "$BASE/munge"
[[ -s $BASE/munge/munge.key ]] || mungekey -c -k "$BASE/munge/munge.key"
chmod 400 "$BASE/munge/munge.key"
# the socket directory needs o+x, else munged exits ("Socket is inaccessible: execute permissions")
chmod 711 "$BASE/munge"
munged -S "$MUNGE_SOCK" --key-file="$BASE/munge/munge.key" \
       --log-file="$BASE/log/munged.log" --pid-file="$BASE/run/munged.pid" \
       --seed-file="$BASE/munge/munged.seed"
for _ in $(seq 50); do [[ -S $MUNGE_SOCK ]] && break; sleep 0.1; done
munge -S "$MUNGE_SOCK" -n | unmunge -S "$MUNGE_SOCK" >/dev/null

# ---------------------------------------------------------------- network
NODES=(); for i in $(seq 1 "$NNODES"); do NODES+=("$NODE_PREFIX$i"); done
ip link add "$BR" type bridge
ip addr add "$NET.1/24" dev "$BR"
ip link set "$BR" up
# Docker hosts set FORWARD policy DROP and br_netfilter sends bridged frames through it.
if command -v iptables >/dev/null && [[ $(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null) == 1 ]]; then
  iptables -C FORWARD -i "$BR" -o "$BR" -j ACCEPT 2>/dev/null ||
    iptables -I FORWARD -i "$BR" -o "$BR" -j ACCEPT
fi

HOSTS="127.0.0.1 localhost
$NET.1 slurmhost
$NET.2 $CTL"
for i in $(seq 1 "$NNODES"); do HOSTS+=$'\n'"$NET.$((10+i)) $NODE_PREFIX$i"; done
printf '%s\n' "$HOSTS" > "$BASE/etc/hosts"
# The namespaces have no route to the machine's DNS server: glibc would wait 2x5 s for every name
# not in /etc/hosts (torch's c10d does reverse lookups of peers -> 10 s stalls per init). DNS at
# the namespace's loopback is refused at once.
printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' > "$BASE/etc/resolv.conf"

mk_ns() {  # node-name address veth-suffix
  local ns=$TAG-$1 ip=$2 hv=${TAG}v$3
  ip netns add "$ns"
  ip link add "$hv" type veth peer name eth0 netns "$ns"
  ip link set "$hv" master "$BR" up
  ip -n "$ns" link set lo up   # with lo down torch's rendezvous hangs silently
  ip -n "$ns" addr add "$ip/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$NET.1"
}
mk_ns "$CTL" "$NET.2" c
for i in $(seq 1 "$NNODES"); do mk_ns "$NODE_PREFIX$i" "$NET.$((10+i))" "$i"; done

# ---------------------------------------------------------------- slurm.conf
NODELINES=""; GRES=""; GRESTYPES=""
if (( FAKE_GPUS > 0 )); then
  # gres/gpu needs device files; only the variables (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES) are
  # real. Char devices 1:3 (= /dev/null): plain files are rejected ("not a valid character or block
  # device") and then CUDA_VISIBLE_DEVICES is not set.
  mkdir -p "$BASE/dev"
  for g in $(seq 0 $((FAKE_GPUS-1))); do mknod -m 666 "$BASE/dev/fakegpu$g" c 1 3; done
  printf 'AutoDetect=off\nName=gpu File=%s/dev/fakegpu[0-%d]\n' "$BASE" $((FAKE_GPUS-1)) > "$BASE/etc/gres.conf"
  GRES=" Gres=gpu:$FAKE_GPUS"; GRESTYPES="GresTypes=gpu"
fi
for i in $(seq 1 "$NNODES"); do
  NODELINES+="NodeName=$NODE_PREFIX$i NodeAddr=$NET.$((10+i)) NodeHostname=$NODE_PREFIX$i CPUs=$NODE_CPUS Sockets=1 CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=1000$GRES State=UNKNOWN"$'\n'
done
cat > "$CONF" <<CONF_EOF
ClusterName=testbed
SlurmctldHost=$CTL($NET.2)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a job credential lives, and so how long a requeued job waits before it may
# start again (slurmd still holds the revoked credential: a start before that is "Job credential
# revoked"). 120 s by default; 5 s here so that the requeue test does not wait two minutes
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SchedulerType=sched/builtin
# the default batch_sched_delay=3 s delays every sbatch job start by up to 3 s
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# sbatch --wait polls after 2 s, then x4 while < MinJobAge/2: MinJobAge=4 -> ~2 s, 30 -> ~10 s
MinJobAge=$MIN_JOB_AGE
$GRESTYPES
$NODELINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF_EOF
chmod 644 "$CONF"
# slurmd 22.05 ALWAYS loads a cgroup plugin (even with proctrack/linuxproc + task/none). Pin v1:
# with CGROUP_TMPFS=1 it initialises against an empty tmpfs and never touches the machine's cgroups.
if [[ $CGROUP_TMPFS == 1 ]]; then echo "CgroupPlugin=cgroup/v1" > "$BASE/etc/cgroup.conf"; fi
export SLURM_CONF=$CONF

# ---------------------------------------------------------------- daemons
# NOT `ip netns exec`: it remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05 then dies with
# "Unable to initialize cgroup plugin". Instead: a private mount + UTS namespace (own /etc/hosts,
# resolv.conf and hostname), then join the network namespace. Jobs inherit all three from slurmd.
in_node() {  # node-name hostname cmd...
  local ns=$TAG-$1 h=$2; shift 2
  unshare --mount --uts --propagation private sh -c \
    'e=$1 h=$2 n=$3; shift 3; mount --bind "$e/hosts" /etc/hosts &&
     mount --bind "$e/resolv.conf" /etc/resolv.conf && hostname "$h" &&
     { [ "$CGROUP_TMPFS" != 1 ] || mount -t tmpfs -o size=1m slurm-nocgroup /sys/fs/cgroup; } &&
     exec nsenter --net="$n" "$@"' \
    in_node "$BASE/etc" "$h" "/run/netns/$ns" "$@"
}
in_node "$CTL" "$CTL" slurmctld -f "$CONF"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || { echo "slurmctld not up, see $BASE/log/slurmctld.log" >&2; exit 1; }
for n in "${NODES[@]}"; do
  mkdir -p "$BASE/spool/$n"
  in_node "$n" "$n" slurmd -f "$CONF" -N "$n"
done

# ---------------------------------------------------------------- wait for idle
st=""
for _ in $(seq 300); do
  st=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
  [[ $st == "idle " ]] && break
  sleep 0.1
done
sinfo -N
[[ $st == "idle " ]] || { echo "nodes not idle: $st (see $BASE/log/slurmd-*.log)" >&2; exit 1; }
echo "cluster up in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s ; export SLURM_CONF=$CONF"
