#!/usr/bin/env bash
# py-spy flame graphs of every rank of a torchrun job: one SVG per rank, and one per vLLM engine core.
#
#   scripts/flamegraph.sh [--duration S] [--delay S] [--native] [--rate HZ] [--format F[,F]] [--also gil,idle]
#                         [--out DIR] --pid PID
#       record the ranks of a running job; PID is the torchrun launcher (or any ancestor of the ranks):
#       start the job with `&` and pass `$!` (a `pgrep -f` pattern also matches the shell running it)
#   scripts/flamegraph.sh [options] -- COMMAND...
#       start COMMAND (e.g. torchrun --nproc-per-node 2 -m colocate.train ...), record its ranks
#
# Ranks are found as descendants of PID whose environment has RANK=<n>; each is recorded in
# parallel with `py-spy record` into DIR/rank<n>.svg (default DIR: profiles/flamegraphs). An
# inference rank's vLLM engine core (its child process "EngineCore", which does the scheduling,
# the grammar masks and the GPU launches) goes to DIR/rank<n>-enginecore.svg. --delay waits
# before recording (past engine start-up); --format flamegraph (default), raw (collapsed stacks,
# .txt, for scripts) or speedscope (.json), several comma-separated. --also records the same
# targets again at once: `gil` only the thread holding the GIL (DIR/<name>-gil.*: who keeps the
# others waiting), `idle` idle samples too (DIR/<name>-idle.*: where threads block).
# --native adds C/C++ frames (slower, needs symbols). py-spy needs ptrace: in a container, run with
# CAP_SYS_PTRACE or as root with kernel.yama.ptrace_scope <= 1.
set -euo pipefail

duration=20 delay=0 native="" rate=100 formats="flamegraph" also="" out="profiles/flamegraphs" pid="" cmd=()
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --format) formats=$2; shift 2 ;;
    --also) also=$2; shift 2 ;;
    --native) native="--native"; shift ;;
    --rate) rate=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --pid) pid=$2; shift 2 ;;
    --) shift; cmd=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "flamegraph.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v py-spy >/dev/null || { echo "flamegraph.sh: py-spy not found (pip install -e '.[profile]')" >&2; exit 2; }
if [ -z "$pid" ] && [ ${#cmd[@]} -eq 0 ]; then echo "flamegraph.sh: give --pid PID or -- COMMAND" >&2; exit 2; fi
mkdir -p "$out"

started=""
if [ ${#cmd[@]} -gt 0 ]; then
  "${cmd[@]}" &
  pid=$! started=1
fi

descendants() {  # all descendant pids of $1
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}
env_of() {  # VAR=<value> from a process environment ($2 = VAR), empty if none
  { tr '\0' '\n' < "/proc/$1/environ"; } 2>/dev/null | sed -n "s/^$2=//p" | head -n1 || true  # may have exited
}

# Wait (up to 120 s) until every rank exists (WORLD_SIZE of them: torchrun may start one later
# than another on a loaded machine) and has imported Python.
declare -A ranks
world=0
for _ in $(seq 1 240); do
  ranks=()
  for p in $(descendants "$pid"); do
    r=$(env_of "$p" RANK)
    [ -n "$r" ] && [ -z "${ranks[$r]:-}" ] && { ranks[$r]=$p; world=$(env_of "$p" WORLD_SIZE); }
  done
  [ ${#ranks[@]} -gt 0 ] && [ ${#ranks[@]} -ge "${world:-1}" ] && break
  sleep 0.5
done
[ ${#ranks[@]} -gt 0 ] || { echo "flamegraph.sh: no ranks (RANK=...) under pid $pid" >&2; exit 1; }
[ ${#ranks[@]} -ge "${world:-1}" ] || echo "flamegraph.sh: found ${#ranks[@]} of $world ranks; recording those" >&2
sleep 2  # let them get past start-up
sleep "$delay"

# name -> pid: rank<n>, and rank<n>-enginecore for a vLLM engine core under rank n
declare -A targets
for r in "${!ranks[@]}"; do
  targets[rank$r]=${ranks[$r]}
  for p in $(descendants "${ranks[$r]}"); do
    if { tr '\0' ' ' < "/proc/$p/cmdline"; } 2>/dev/null | grep -q EngineCore; then targets[rank$r-enginecore]=$p; break; fi
  done
done

recorders=()
for name in "${!targets[@]}"; do
  for fmt in ${formats//,/ }; do
    case $fmt in flamegraph) ext=svg ;; raw) ext=txt ;; speedscope) ext=json ;;
      *) echo "flamegraph.sh: unknown format $fmt" >&2; exit 2 ;; esac
    for kind in plain ${also//,/ }; do
      case $kind in plain) flag="" suffix="" ;; gil) flag="--gil" suffix="-gil" ;; idle) flag="--idle" suffix="-idle" ;;
        *) echo "flamegraph.sh: unknown --also $kind" >&2; exit 2 ;; esac
      py-spy record --pid "${targets[$name]}" --duration "$duration" --rate "$rate" $native $flag --nonblocking \
        --format "$fmt" --output "$out/$name$suffix.$ext" >"$out/$name$suffix.$fmt.log" 2>&1 &
      recorders+=($!)
    done
  done
done
status=0
for p in "${recorders[@]}"; do wait "$p" || status=1; done
if [ -n "$started" ]; then wait "$pid" || true; fi
for name in "${!targets[@]}"; do
  for f in "$out/$name".*; do
    case $f in *.log) ;; *) [ -s "$f" ] && echo "$name: $f" ;; esac
  done
done
exit $status
