#!/usr/bin/env bash
# bench/run.sh: infermesh's proxy against the direct connection, nginx and
# haproxy, side by side, on loopback (`make bench`; BENCH_QUICK=1 for the
# quick mode CI runs, `make bench-quick`).
#
# It starts three demo-model upstreams (small answers at once; a stream of
# 64 deltas 20 ms apart; slow streams for the concurrent-streams workload),
# every contender in front of them with a config written here, and the Go
# load generator (bench/loadgen), which prints the tables and writes them to
# bench/results/ (markdown and JSON).
#
# A contender is one function `contender_<name>` that starts it and calls
# `entry` with its three addresses, the model names clients ask for and the
# pids whose RSS is sampled and summed (or `missing "<why>"`), plus its name
# in CONTENDERS. The first contender must be `direct`. infermesh-quic is two
# agents (a consuming over QUIC what b serves); its RSS is a + b.
#
# Environment: BENCH_QUICK=1 quick mode; BENCH_KEEP=1 keeps the work
# directory (configs and logs); BENCH_ARGS extra loadgen flags;
# BENCH_COMPARE=<path to another infermeshd, or a git ref> adds it as the contender
# infermesh-before, measured in the same run (to compare two builds).
# BENCH_INSTR_ONLY="<contender> ..." counts instructions for those contenders
# alone (BENCH_INSTR_N requests each) and stops; with BENCH_KEEP=1 their
# callgrind outputs stay in the work directory (cg-<contender>/) for
# callgrind_annotate (build bin/ without -s -w to see symbols).
#
# The instruction counts also count infermesh_info: the local path with
# the log at level info, the default (the timed contenders log at warn), its
# access log written to a file, so the report shows what the access log
# costs per request. BENCH_INFO=1 also times it (as infermesh-info), so
# its CPU per request at c=64 shows the log's write system calls too,
# which callgrind does not count.
#
# The report's header gives how long each phase took (the instruction
# counts, the routing benchmark, the contenders' start, then the load
# generator's) and the load average at the start and the end.
#
# The routing benchmark (routing_phase below) runs before the contenders
# start, with processes of its own that it stops when done: engines (the
# demo model in engine mode: slots, a FIFO queue, a prefix cache, vLLM's
# metrics) behind a real mesh of six agents on 127.0.0.1-6 (memberlist,
# QUIC, static trust). Peers b, c and d serve role chat, each from its own
# engine; consumers a and e have no instance; consumer f serves chat too,
# from its own engine (the busy local instance). The load generator
# measures each topology's capacity, then sends the same seeded workload at
# 0.5x, 1x and 1.3x of it through its own routers (round robin, least
# outstanding, an oracle with per-tenant affinity) straight to the engines,
# and through the consumers' loopback ports. BENCH_ONLY=routing runs that
# phase alone (nothing else is started or installed) and writes its report
# to bench/results/*-routing.md; BENCH_ROUTING_ARGS adds load generator
# flags to it (-routing-popularity zipf, -routing-turns 3, -routing-seed N,
# -routing-rates 1, -routing-window 4s); BENCH_ROUTING_POLICY replaces the
# consumers' routing mapping ("{policy: local-first}"); BENCH_SKIP_ROUTING=1
# leaves it out. BENCH_ROUTING_LOG=info (with BENCH_KEEP=1) keeps the
# agents' access logs, with every routing decision, in the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_STARTED=$(date +%s)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)

CONTENDERS=(direct infermesh infermesh_quic nginx nginx_tls haproxy)
[ -z "${BENCH_COMPARE:-}" ] || CONTENDERS+=(infermesh_before)
# Counted under callgrind; timed too under BENCH_INFO=1.
INSTR_EXTRA=(infermesh_info)
[ "${BENCH_INFO:-0}" != 1 ] || { CONTENDERS+=(infermesh_info) && INSTR_EXTRA=(); }

ONLY=${BENCH_ONLY:-}
[ -z "$ONLY" ] || [ "$ONLY" = routing ] || { echo "bench: BENCH_ONLY=$ONLY: only routing runs alone" >&2; exit 2; }
QUICK=${BENCH_QUICK:-0}
if [ "$QUICK" = 1 ]; then
  MANY_TOKENS=8 # 2 s streams
  LOADGEN_MODE=-quick
else
  MANY_TOKENS=32 # 8 s streams: opened at 1000/s, all 4096 are open at once
  LOADGEN_MODE=
fi
STREAM_TOKENS=64
STREAM_DELAY=20ms
MANY_DELAY=250ms

WORK=$(mktemp -d /tmp/infermesh-bench.XXXXXX)
PIDS=()
cleanup() {
  local rc=$?
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ "${BENCH_KEEP:-0}" = 1 ] || [ $rc -ne 0 ]; then
    echo "bench: work directory (configs, logs) kept in $WORK" >&2
  else
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT
log() { echo "$(date +%T)  $*" >&2; }
die() { log "error: $*"; exit 1; }

# phase_done <name> <start (date +%s.%N)>: record how long a phase took
# for the report's header.
PHASES=()
phase_done() {
  local secs
  secs=$(awk -v a="$2" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  PHASES+=("$(printf '{"name":"%s","seconds":%s}' "$1" "$secs")")
  log "phase $1 took ${secs}s"
}

# 4096 streams through a proxy hold 8192 sockets in it.
ulimit -Hn 65536 2>/dev/null || true
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
[ "$(ulimit -n)" -ge 10000 ] || log "warning: ulimit -n is $(ulimit -n); 4096 concurrent streams need ~10000"

# nginx, haproxy and valgrind (instruction counts) from Debian's packages
# when missing.
need=()
if [ -z "$ONLY" ]; then
  command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
  command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
export PATH=$PATH:/usr/sbin

# Binaries: make bench builds bin/; the load generator is built here.
GO=${GO:-go}
[ -x bin/infermeshd ] && [ -x bin/infermesh-demo ] && [ -x bin/infermesh ] || CGO_ENABLED=0 $GO build -trimpath -o bin/ ./cmd/infermeshd ./cmd/infermesh-demo ./cmd/infermesh
$GO build -o "$WORK/loadgen" ./bench/loadgen
LOADGEN=$WORK/loadgen

# BENCH_COMPARE names a binary, or a git ref built here into the work dir.
if [ -n "${BENCH_COMPARE:-}" ] && [ ! -x "$BENCH_COMPARE" ]; then
  ref=$BENCH_COMPARE
  git rev-parse --verify -q "$ref^{commit}" >/dev/null || die "BENCH_COMPARE=$ref is neither an executable nor a git ref"
  log "building infermeshd at $ref ($(git rev-parse --short "$ref^{commit}")) for infermesh-before"
  mkdir -p "$WORK/compare-src"
  git archive "$ref" | tar -x -C "$WORK/compare-src"
  (cd "$WORK/compare-src" && CGO_ENABLED=0 $GO build -trimpath -o "$WORK/infermeshd-before" ./cmd/infermeshd)
  BENCH_COMPARE=$WORK/infermeshd-before
fi

# 0-33 the contenders', 34-57 the routing benchmark's.
mapfile -t PORTS < <("$LOADGEN" -free-ports 58)
port() { echo "${PORTS[$1]}"; }
P_FAST=$(port 0) P_STREAM=$(port 1) P_MANY=$(port 2)

# wait_http <url> [body]: until the URL answers 200 (POST when a body is
# given); gives up after 10 s or as soon as the last started process exits.
WAIT_TRIES=100 # x 0.1 s; more while the contenders run under valgrind
wait_http() {
  local url=$1 body=${2:-} i
  for i in $(seq 1 "$WAIT_TRIES"); do
    [ -z "$LAST_PID" ] || kill -0 "$LAST_PID" 2>/dev/null || return 1
    if [ -n "$body" ]; then
      curl -fsS -o /dev/null -m 2 "$url" -H 'Content-Type: application/json' -d "$body" 2>/dev/null && return 0
    else
      curl -fsS -o /dev/null -m 2 "$url" 2>/dev/null && return 0
    fi
    sleep 0.1
  done
  return 1
}
chat_body() { printf '{"model":"%s","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}' "$1"; }

# start <name> <cmd...>: run in the background, output to $WORK/<name>.log.
# WRAP is a command prefix for contenders (the instruction count runs
# them under callgrind).
LAST_PID=
WRAP=()
start() {
  local name=$1
  shift
  "${WRAP[@]}" "$@" >"$WORK/$name.log" 2>&1 &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# --- the routing benchmark -------------------------------------------------
# Engine timings, scaled down so that a run takes seconds: prefill 100 us
# per uncached prompt token (a 2,100-token prompt takes 210 ms, 12 ms with
# its tenant's 1,984-token system prompt cached), decode 5 ms per token and
# 32 output tokens, so a request holds its slot about 0.17 s warm and 0.37 s
# cold, where a real one holds it for seconds (hundreds of output tokens at
# 10-20 ms). Each engine's cache holds 16,384 tokens: 8 of the 16 tenants'
# prefixes. Affinity keeps about 16/3 tenants on each engine, which fit;
# spreading every tenant over every engine does not.
ROUTING_SLOTS=4
ROUTING_PREFILL=100us
ROUTING_DECODE=5ms
ROUTING_TOKENS=32
ROUTING_CACHE=16384
ROUTING_BLOCK=64
# The consumers' routing: policy auto (the default), and a queue at the
# agent for when every engine's slots are taken (late binding: a request
# goes to the first slot that frees, not into one engine's queue).
ROUTING_POLICY=${BENCH_ROUTING_POLICY:-"{policy: auto, queue: {max: 256, timeout: 30s}}"}

# routing_phase starts the engines and the six agents, waits until every
# consumer has every peer as a candidate, runs the load generator's routing
# phase (its arguments are appended) and stops everything it started.
routing_phase() {
  local d=$WORK/routing first=${#PIDS[@]} t0 n i node others role join want spec
  t0=$(date +%s.%N)
  rm -rf "$d"
  mkdir -p "$d"
  # Each node's loopback address; the engines' PORTS indexes; then three
  # ports a node (gossip, QUIC, the role's) from index 38 on.
  local -A IP=([a]=127.0.0.1 [b]=127.0.0.2 [c]=127.0.0.3 [d]=127.0.0.4 [e]=127.0.0.5 [f]=127.0.0.6)
  local -A ENG=([b]=34 [c]=35 [d]=36 [f]=37)
  local -A GOSSIP QUICP ROLE KEY
  local nodes=(a b c d e f) idx=38
  for node in "${nodes[@]}"; do
    GOSSIP[$node]=$(port $idx) QUICP[$node]=$(port $((idx + 1))) ROLE[$node]=$(port $((idx + 2)))
    idx=$((idx + 3))
    mkdir -p "$d/$node"
    KEY[$node]=$(bin/infermesh keygen --state-dir "$d/$node" | head -1) || die "routing: infermesh keygen for $node failed"
  done
  bin/infermesh keygen --gossip --keyring "$d/a/keyring.json" >/dev/null || die "routing: infermesh keygen --gossip failed"
  eng_addr() { echo "${IP[$1]}:$(port "${ENG[$1]}")"; }
  for node in b c d f; do
    start "routing-engine-$node" bin/infermesh-demo -listen "$(eng_addr $node)" -model demo -log-level warn \
      -parallel "$ROUTING_SLOTS" -prefill-per-token "$ROUTING_PREFILL" -decode-per-token "$ROUTING_DECODE" -tokens "$ROUTING_TOKENS" \
      -cache-tokens "$ROUTING_CACHE" -cache-block "$ROUTING_BLOCK" -metrics vllm
  done
  for node in b c d f; do
    wait_http "http://$(eng_addr $node)/health" || die "routing: engine $node did not start (see $WORK/routing-engine-$node.log)"
  done
  for node in "${nodes[@]}"; do
    [ "$node" = a ] || cp -p "$d/a/keyring.json" "$d/$node/keyring.json"
    others=
    for i in "${nodes[@]}"; do
      [ "$i" = "$node" ] || others+="{name: $i, public_key: \"${KEY[$i]}\"}, "
    done
    join=
    [ "$node" = a ] || join=", join: [\"${IP[a]}:${GOSSIP[a]}\"]"
    case $node in
      b | c | d) role="{port: ${ROLE[$node]}, upstream: \"http://$(eng_addr "$node")\", model: demo, expose: true, serve_to: [a, e, f]}" ;;
      a | e) role="{port: ${ROLE[$node]}, accept_from: [b, c, d], routing: $ROUTING_POLICY}" ;;
      f) role="{port: ${ROLE[$node]}, upstream: \"http://$(eng_addr f)\", model: demo, accept_from: [b, c, d], routing: $ROUTING_POLICY}" ;;
    esac
    cat >"$d/$node.yaml" <<EOF
node: {name: $node, state_dir: $d/$node}
log: {level: ${BENCH_ROUTING_LOG:-warn}}
admin: {socket: $d/$node/admin.sock}
mesh: {bind: "${IP[$node]}:${GOSSIP[$node]}", quic: "${IP[$node]}:${QUICP[$node]}"$join}
trust: {nodes: [${others%, }]}
roles:
  chat: $role
EOF
    start "routing-$node" bin/infermeshd -config "$d/$node.yaml"
  done
  # Until each consumer has every peer (and f its own engine too) as a
  # candidate for chat, and answers through it.
  for node in a e f; do
    want=3
    [ "$node" = f ] && want=4
    for i in $(seq 1 300); do
      n=$(bin/infermesh --socket "$d/$node/admin.sock" --json route chat 2>/dev/null | grep -c '"candidate": *true' || true)
      [ "$n" -ge "$want" ] && break
      [ "$i" -lt 300 ] || die "routing: $node has $n of $want candidates for chat after 30 s (see $WORK/routing-*.log)"
      sleep 0.1
    done
    wait_http "http://127.0.0.1:${ROLE[$node]}/v1/chat/completions" "$(chat_body chat)" || die "routing: chat not served through $node"
  done
  local scale="Scaled down so that a run takes seconds: $ROUTING_TOKENS output tokens, so a request holds its slot about 0.17 s with its prefix cached and 0.37 s without (a real one holds it for seconds: hundreds of tokens at 10-20 ms); each cache holds 8 of the 16 tenants' prefixes, so affinity (16/3 tenants an engine) fits where spreading every tenant everywhere does not."
  local e3='{"name":"b","addr":"%s"},{"name":"c","addr":"%s"},{"name":"d","addr":"%s"}'
  # The quick mode runs the rates the targets name only: the three peers at
  # 1x and 1.3x, the busy local instance at 1x.
  local rates1= rates2=
  [ "$QUICK" = 1 ] && rates1=',"rates":[1,1.3]' rates2=',"rates":[1]'

  spec=$(printf '{"engine":{"slots":%d,"prefill_per_token":"%s","decode_per_token":"%s","cache_tokens":%d,"cache_block":%d,"model":"demo","scale":"%s"},"topologies":[' \
    "$ROUTING_SLOTS" "$ROUTING_PREFILL" "$ROUTING_DECODE" "$ROUTING_CACHE" "$ROUTING_BLOCK" "$scale")
  spec+=$(printf '{"name":"peers","desc":"consumer a (no instance) → QUIC → peers b, c, d, one engine each","engines":['"$e3"'],' \
    "$(eng_addr b)" "$(eng_addr c)" "$(eng_addr d)")
  spec+=$(printf '"mesh":[{"name":"infermesh","desc":"through consumer a","addrs":["127.0.0.1:%s"],"model":"chat"},{"name":"infermesh-2","desc":"alternately through consumers a and e","addrs":["127.0.0.1:%s","127.0.0.1:%s"],"model":"chat"}]%s},' \
    "${ROLE[a]}" "${ROLE[a]}" "${ROLE[e]}" "$rates1")
  spec+=$(printf '{"name":"local","desc":"consumer f serves chat too, from its own engine, beside peers b, c, d","engines":[{"name":"f","addr":"%s"},'"$e3"'],' \
    "$(eng_addr f)" "$(eng_addr b)" "$(eng_addr c)" "$(eng_addr d)")
  spec+=$(printf '"mesh":[{"name":"infermesh","desc":"through consumer f","addrs":["127.0.0.1:%s"],"model":"chat"}]%s}]}' "${ROLE[f]}" "$rates2")
  echo "$spec" >"$d/spec.json"
  log "routing: 4 engines and 6 agents up; running the routing phase"
  local mode=
  [ "$QUICK" = 1 ] && mode=-quick
  # shellcheck disable=SC2086
  "$LOADGEN" -routing "$d/spec.json" $mode "$@" ${BENCH_ROUTING_ARGS:-} || die "routing: the load generator failed"
  for ((i = first; i < ${#PIDS[@]}; i++)); do
    kill -0 "${PIDS[$i]}" 2>/dev/null || die "routing: process ${PIDS[$i]} exited during the phase (see $WORK/routing-*.log)"
  done
  for ((i = first; i < ${#PIDS[@]}; i++)); do kill "${PIDS[$i]}" 2>/dev/null || true; done
  for ((i = first; i < ${#PIDS[@]}; i++)); do wait "${PIDS[$i]}" 2>/dev/null || true; done
  PIDS=("${PIDS[@]:0:first}")
  phase_done "routing" "$t0"
}

if [ "$ONLY" = routing ]; then
  printf '{"started":%d,"loadavg_start":"%s","phases":[]}\n' "$RUN_STARTED" "$LOAD_START" >"$WORK/harness.json"
  routing_phase -out bench/results -harness "$WORK/harness.json"
  exit 0
fi

# --- the upstream: the demo model -----------------------------------------
start demo-fast bin/infermesh-demo -listen "127.0.0.1:$P_FAST" -log-level warn
PID_FAST=$LAST_PID
start demo-stream bin/infermesh-demo -listen "127.0.0.1:$P_STREAM" -log-level warn -tokens "$STREAM_TOKENS" -token-delay "$STREAM_DELAY"
start demo-many bin/infermesh-demo -listen "127.0.0.1:$P_MANY" -log-level warn -tokens "$MANY_TOKENS" -token-delay "$MANY_DELAY"
PID_MANY=$LAST_PID
for p in "$P_FAST" "$P_STREAM" "$P_MANY"; do
  wait_http "http://127.0.0.1:$p/health" || die "demo model on port $p did not start (see $WORK/demo-*.log)"
done

# --- contenders -------------------------------------------------------------
ENTRIES=()
# entry <name> <desc> <fast addr> <fast model> <stream addr> <stream model> <many addr> <many model> <pids>
# (pids: comma-separated; their RSS is summed)
# (LAST_ADDR, LAST_MODEL and LAST_PIDS keep its fast address, model and pids.)
entry() {
  LAST_ADDR=$3 LAST_MODEL=$4 LAST_PIDS=$9
  ENTRIES+=("$(printf '{"name":"%s","desc":"%s","fast":{"addr":"%s","model":"%s"},"stream":{"addr":"%s","model":"%s"},"many":{"addr":"%s","model":"%s"},"pids":[%s]}' "$@")")
}
# cpu_pids <pids>: the processes (comma-separated; their descendants too)
# whose CPU per request the last entry reports at c=64.
cpu_pids() { ENTRIES[-1]="${ENTRIES[-1]%\}}"',"cpu_pids":['"$1"']}'; }
# missing <name> <desc> <why>
missing() { ENTRIES+=("$(printf '{"name":"%s","desc":"%s","missing":"%s"}' "$@")"); }

contender_direct() {
  entry direct "direct to the upstream (the limit)" \
    "127.0.0.1:$P_FAST" demo "127.0.0.1:$P_STREAM" demo "127.0.0.1:$P_MANY" demo "$PID_MANY"
  cpu_pids "$PID_FAST" # the upstream the c=64 workload loads
}

# infermesh_at <name> <binary> <three ports> [log level, default warn]
infermesh_at() {
  local name=$1 bin=$2 p1=$3 p2=$4 p3=$5 level=${6:-warn} d=$WORK/$1
  mkdir -p "$d/state"
  # Clients ask for the role's name; the instance knows its model as
  # "demo": every request is pinned and every response rewritten back.
  cat >"$d/infermesh.yaml" <<EOF
node: {name: bench, state_dir: $d/state}
log: {level: $level}
admin: {socket: $d/state/admin.sock}
roles:
  chat:   {port: $p1, upstream: "http://127.0.0.1:$P_FAST", model: demo}
  stream: {port: $p2, upstream: "http://127.0.0.1:$P_STREAM", model: demo}
  many:   {port: $p3, upstream: "http://127.0.0.1:$P_MANY", model: demo}
EOF
  start "$name" "$bin" -config "$d/infermesh.yaml"
  local pid=$LAST_PID
  wait_http "http://127.0.0.1:$p1/v1/chat/completions" "$(chat_body chat)" || die "$name did not start (see $WORK/$name.log)"
  wait_http "http://127.0.0.1:$p2/v1/models" && wait_http "http://127.0.0.1:$p3/v1/models" || die "infermeshd roles not up"
  wait_http "http://127.0.0.1:$p3/v1/chat/completions" "$(chat_body many)" || die "infermeshd role many not served"
  wait_http "http://127.0.0.1:$p2/v1/chat/completions" "$(chat_body stream)" || die "infermeshd role stream not served"
  entry "$name" "infermeshd, local path (model pinned and rewritten), log level $level" \
    "127.0.0.1:$p1" chat "127.0.0.1:$p2" stream "127.0.0.1:$p3" many "$pid"
  cpu_pids "$pid"
}

contender_infermesh() { infermesh_at infermesh bin/infermeshd "$(port 3)" "$(port 4)" "$(port 5)"; }

# The local path logging at info, the default: one access-log line per
# request, JSON to its log file in the work directory (counted only).
contender_infermesh_info() { infermesh_at infermesh-info bin/infermeshd "$(port 31)" "$(port 32)" "$(port 33)" info; }

contender_infermesh_before() { infermesh_at infermesh-before "$BENCH_COMPARE" "$(port 12)" "$(port 13)" "$(port 14)"; }

# The remote path: two agents on loopback. A (127.0.0.1) has the three
# roles with no local instance and accepts them from B; B (127.0.0.2)
# serves them from the same demo upstreams, exposed to A only. Node keys
# and the gossip keyring are made with `infermesh keygen`, trust is static
# both ways (trust.nodes), as in the README's "Building a mesh". The load
# generator talks to A only; RSS is sampled from A and B together.
contender_infermesh_quic() {
  local d=$WORK/quic pa=(15 16 17) pb=(18 19 20) ka kb pid_a pid_b role i
  local a_gossip=127.0.0.1:$(port 21) a_quic=127.0.0.1:$(port 22)
  local b_gossip=127.0.0.2:$(port 23) b_quic=127.0.0.2:$(port 24)
  rm -rf "$d" # started twice: under callgrind, then for the timed runs
  mkdir -p "$d/a" "$d/b"
  ka=$(bin/infermesh keygen --state-dir "$d/a" | head -1) || die "infermesh keygen for a failed"
  kb=$(bin/infermesh keygen --state-dir "$d/b" | head -1) || die "infermesh keygen for b failed"
  bin/infermesh keygen --gossip --keyring "$d/a/keyring.json" >/dev/null || die "infermesh keygen --gossip failed"
  cp -p "$d/a/keyring.json" "$d/b/keyring.json"
  cat >"$d/a.yaml" <<EOF
node: {name: a, state_dir: $d/a}
log: {level: warn}
admin: {socket: $d/a/admin.sock}
mesh: {bind: "$a_gossip", quic: "$a_quic"}
trust: {nodes: [{name: b, public_key: "$kb"}]}
roles:
  chat:   {port: $(port "${pa[0]}"), accept_from: [b]}
  stream: {port: $(port "${pa[1]}"), accept_from: [b]}
  many:   {port: $(port "${pa[2]}"), accept_from: [b]}
EOF
  cat >"$d/b.yaml" <<EOF
node: {name: b, state_dir: $d/b}
log: {level: warn}
admin: {socket: $d/b/admin.sock}
mesh: {bind: "$b_gossip", quic: "$b_quic", join: ["$a_gossip"]}
trust: {nodes: [{name: a, public_key: "$ka"}]}
roles:
  chat:   {port: $(port "${pb[0]}"), upstream: "http://127.0.0.1:$P_FAST", model: demo, expose: true, serve_to: [a]}
  stream: {port: $(port "${pb[1]}"), upstream: "http://127.0.0.1:$P_STREAM", model: demo, expose: true, serve_to: [a]}
  many:   {port: $(port "${pb[2]}"), upstream: "http://127.0.0.1:$P_MANY", model: demo, expose: true, serve_to: [a]}
EOF
  start infermesh-quic-a bin/infermeshd -config "$d/a.yaml"
  pid_a=$LAST_PID
  start infermesh-quic-b bin/infermeshd -config "$d/b.yaml"
  pid_b=$LAST_PID
  # Until A routes every role to B (B joined, admitted, advertised).
  for role in chat stream many; do
    for i in $(seq 1 $((WAIT_TRIES * 3 / 2))); do
      kill -0 "$pid_a" 2>/dev/null && kill -0 "$pid_b" 2>/dev/null || die "an infermesh-quic agent exited (see $WORK/infermesh-quic-[ab].log)"
      bin/infermesh --socket "$d/a/admin.sock" --json route "$role" 2>/dev/null | grep -q '"serving": *"b"' && break
      [ "$i" -lt $((WAIT_TRIES * 3 / 2)) ] || die "infermesh-quic: a does not route $role to b after $((WAIT_TRIES * 3 / 20)) s (see $WORK/infermesh-quic-[ab].log; BENCH_KEEP=1 keeps them)"
      sleep 0.1
    done
  done
  wait_http "http://127.0.0.1:$(port "${pa[0]}")/v1/chat/completions" "$(chat_body chat)" || die "infermesh-quic: chat not served through b"
  wait_http "http://127.0.0.1:$(port "${pa[1]}")/v1/chat/completions" "$(chat_body stream)" || die "infermesh-quic: stream not served through b"
  wait_http "http://127.0.0.1:$(port "${pa[2]}")/v1/chat/completions" "$(chat_body many)" || die "infermesh-quic: many not served through b"
  entry infermesh-quic "infermeshd a -> QUIC (HTTP/3, mTLS) -> infermeshd b -> upstream; RSS is a + b" \
    "127.0.0.1:$(port "${pa[0]}")" chat "127.0.0.1:$(port "${pa[1]}")" stream "127.0.0.1:$(port "${pa[2]}")" many "$pid_a,$pid_b"
  ENTRIES[-1]="${ENTRIES[-1]%\}}"',"pid_names":["a","b"]}'
  cpu_pids "$pid_a,$pid_b"
  # The UDP buffers in force on a's QUIC socket (quic-go asks for 7 MiB;
  # as root it may exceed net.core.rmem_max), and quic-go's complaint when
  # it could not get them.
  QUIC_SOCKET=$(ss -H -uamn "sport = :$(port 22)" 2>/dev/null | grep -o 'rb[0-9]*\|tb[0-9]*' | tr '\n' ' ' | sed 's/ $//' || true)
  QUIC_SOCKET="a's socket ${QUIC_SOCKET:-unknown}"
  ! grep -q 'failed to sufficiently increase' "$WORK"/infermesh-quic-[ab].log 2>/dev/null ||
    QUIC_SOCKET="$QUIC_SOCKET; quic-go: $(grep -ho 'failed to sufficiently increase[^.]*' "$WORK"/infermesh-quic-[ab].log | head -1)"
}

contender_nginx() {
  local d=$WORK/nginx p1 p2 p3
  p1=$(port 6) p2=$(port 7) p3=$(port 8)
  mkdir -p "$d/tmp"
  # One worker, a keep-alive pool to each upstream, no request limit per
  # connection (nginx closes keep-alive connections after 1000 requests by
  # default), no buffering of streams.
  # Under callgrind nginx runs as one process (master_process off): a worker
  # that dropped privileges cannot be reached by valgrind's vgdb.
  local single=
  [ ${#WRAP[@]} -eq 0 ] || single="master_process off;"
  cat >"$d/nginx.conf" <<EOF
$single
worker_processes 1;
worker_rlimit_nofile 20000;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 10000; }
http {
  access_log off;
  client_body_temp_path $d/tmp/body;
  proxy_temp_path $d/tmp/proxy;
  fastcgi_temp_path $d/tmp/fastcgi;
  uwsgi_temp_path $d/tmp/uwsgi;
  scgi_temp_path $d/tmp/scgi;
  keepalive_requests 10000000;
  keepalive_timeout 120s;
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  upstream fast   { server 127.0.0.1:$P_FAST;   keepalive 128; keepalive_requests 10000000; }
  upstream stream { server 127.0.0.1:$P_STREAM; keepalive 128; keepalive_requests 10000000; }
  upstream many   { server 127.0.0.1:$P_MANY;   keepalive 128; keepalive_requests 10000000; }
  server { listen 127.0.0.1:$p1 backlog=4096; location / { proxy_pass http://fast; } }
  server { listen 127.0.0.1:$p2 backlog=4096; location / { proxy_pass http://stream; proxy_buffering off; } }
  server { listen 127.0.0.1:$p3 backlog=4096; location / { proxy_pass http://many; proxy_buffering off; } }
}
EOF
  start nginx nginx -p "$d" -c "$d/nginx.conf" -e "$d/error.log"
  local master=$LAST_PID worker=
  wait_http "http://127.0.0.1:$p1/v1/chat/completions" "$(chat_body demo)" || die "nginx did not start (see $d/error.log)"
  worker=$(pgrep -P "$master" | head -1 || true)
  [ -z "$single" ] || worker=$master
  entry nginx "nginx $(nginx -v 2>&1 | sed 's|.*/||'), 1 worker, keep-alive upstream pool" \
    "127.0.0.1:$p1" demo "127.0.0.1:$p2" demo "127.0.0.1:$p3" demo "${worker:-0}"
  cpu_pids "$master" # and its worker
}

# The remote hop done with well-known parts, the anchor for infermesh-quic:
# nginx "a" (127.0.0.1) proxies over TLS 1.3 with a client certificate to
# nginx "b" (127.0.0.2), which checks it and proxies to the upstreams; both
# keep their upstream connections alive (a's TLS sessions too). One worker
# each, as the nginx row; RSS is a + b.
contender_nginx_tls() {
  local d=$WORK/nginx-tls pa=(25 26 27) pb=(28 29 30) side i
  local -a up=("127.0.0.1:$P_FAST" "127.0.0.1:$P_STREAM" "127.0.0.1:$P_MANY")
  rm -rf "$d"
  mkdir -p "$d/a/tmp" "$d/b/tmp"
  # A private CA, b's server certificate (for the name b.bench) and a's client
  # certificate, ECDSA P-256.
  (
    cd "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=bench-ca \
      -keyout ca.key -out ca.crt
    for side in a b; do
      openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$side" -keyout "$side.key" -out "$side.csr"
    done
    printf 'subjectAltName=DNS:b.bench\nextendedKeyUsage=serverAuth\n' >b.ext
    printf 'extendedKeyUsage=clientAuth\n' >a.ext
    for side in a b; do
      openssl x509 -req -in "$side.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$side.ext" -out "$side.crt"
    done
  ) >"$d/openssl.log" 2>&1 || die "nginx-tls: certificates (see $d/openssl.log)"
  local common="worker_processes 1;
worker_rlimit_nofile 20000;
daemon off;
events { worker_connections 10000; }"
  [ ${#WRAP[@]} -eq 0 ] || common="master_process off;
$common"
  nginx_http() { # <dir>
    echo "access_log off; client_body_temp_path $1/tmp/body; proxy_temp_path $1/tmp/proxy; fastcgi_temp_path $1/tmp/fastcgi; uwsgi_temp_path $1/tmp/uwsgi; scgi_temp_path $1/tmp/scgi;
  keepalive_requests 10000000; keepalive_timeout 120s; proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off;"
  }
  {
    echo "$common"
    echo "pid $d/b/nginx.pid; error_log $d/b/error.log warn;"
    echo "http { $(nginx_http "$d/b")"
    for i in 0 1 2; do
      echo "  upstream u$i { server ${up[$i]}; keepalive 128; keepalive_requests 10000000; }"
      echo "  server { listen 127.0.0.2:$(port "${pb[$i]}") ssl backlog=4096; ssl_protocols TLSv1.3;
    ssl_certificate $d/b.crt; ssl_certificate_key $d/b.key;
    ssl_client_certificate $d/ca.crt; ssl_verify_client on;
    location / { proxy_pass http://u$i; } }"
    done
    echo "}"
  } >"$d/b/nginx.conf"
  {
    echo "$common"
    echo "pid $d/a/nginx.pid; error_log $d/a/error.log warn;"
    echo "http { $(nginx_http "$d/a")"
    for i in 0 1 2; do
      echo "  upstream b$i { server 127.0.0.2:$(port "${pb[$i]}"); keepalive 128; keepalive_requests 10000000; }"
      echo "  server { listen 127.0.0.1:$(port "${pa[$i]}") backlog=4096;
    location / { proxy_pass https://b$i;
      proxy_ssl_protocols TLSv1.3; proxy_ssl_session_reuse on;
      proxy_ssl_certificate $d/a.crt; proxy_ssl_certificate_key $d/a.key;
      proxy_ssl_trusted_certificate $d/ca.crt; proxy_ssl_verify on; proxy_ssl_name b.bench; } }"
    done
    echo "}"
  } >"$d/a/nginx.conf"
  local pids=() masters=() side master worker
  for side in b a; do
    start "nginx-tls-$side" nginx -p "$d/$side" -c "$d/$side/nginx.conf" -e "$d/$side/error.log"
    master=$LAST_PID
    masters+=("$master")
    if [ "$side" = b ]; then
      for i in $(seq 1 "$WAIT_TRIES"); do
        kill -0 "$master" 2>/dev/null || die "nginx-tls b did not start (see $d/b/error.log)"
        [ -s "$d/b/nginx.pid" ] && break
        sleep 0.1
      done
    else
      wait_http "http://127.0.0.1:$(port "${pa[0]}")/v1/chat/completions" "$(chat_body demo)" || die "nginx-tls did not answer through b (see $d/[ab]/error.log)"
    fi
    worker=$(pgrep -P "$master" | head -1 || true)
    [ ${#WRAP[@]} -eq 0 ] || worker=$master
    pids+=("${worker:-0}")
  done
  entry nginx-tls "nginx a -> TLS 1.3 with client certificates -> nginx b -> upstream; RSS is a + b" \
    "127.0.0.1:$(port "${pa[0]}")" demo "127.0.0.1:$(port "${pa[1]}")" demo "127.0.0.1:$(port "${pa[2]}")" demo "${pids[1]},${pids[0]}"
  ENTRIES[-1]="${ENTRIES[-1]%\}}"',"pid_names":["a","b"]}'
  cpu_pids "${masters[1]},${masters[0]}"
}

contender_haproxy() {
  local d=$WORK/haproxy p1 p2 p3
  p1=$(port 9) p2=$(port 10) p3=$(port 11)
  mkdir -p "$d"
  # http-no-delay on the streaming ports: without it haproxy sends body
  # data with MSG_MORE and SSE events wait up to 200 ms in the kernel.
  cat >"$d/haproxy.cfg" <<EOF
global
  nbthread 1
  maxconn 9000 # 4096 streams hold 8192 sockets; 2 x maxconn must fit ulimit -n
defaults
  mode http
  maxconn 9000
  timeout connect 2s
  timeout client 5m
  timeout server 5m
  timeout http-keep-alive 120s
  http-reuse always
frontend fast
  bind 127.0.0.1:$p1
  default_backend fast
frontend stream
  bind 127.0.0.1:$p2
  option http-no-delay
  default_backend stream
frontend many
  bind 127.0.0.1:$p3
  option http-no-delay
  default_backend many
backend fast
  server s 127.0.0.1:$P_FAST
backend stream
  option http-no-delay
  server s 127.0.0.1:$P_STREAM
backend many
  option http-no-delay
  server s 127.0.0.1:$P_MANY
EOF
  start haproxy haproxy -db -f "$d/haproxy.cfg"
  local pid=$LAST_PID
  wait_http "http://127.0.0.1:$p1/v1/chat/completions" "$(chat_body demo)" || die "haproxy did not start (see $WORK/haproxy.log)"
  entry haproxy "haproxy $(haproxy -v | head -1 | awk '{print $3}'), nbthread 1" \
    "127.0.0.1:$p1" demo "127.0.0.1:$p2" demo "127.0.0.1:$p3" demo "$pid"
  cpu_pids "$pid"
}

# --- instructions per request ---------------------------------------------
# Each proxy (not direct) is started alone under valgrind's callgrind, warmed
# with 200 requests, its counters zeroed, sent INSTR_N small completions at
# c=1 over one connection (loadgen -fixed), and its counters dumped: the
# instructions its processes executed for them, whatever else the host was
# doing. Go programs run with GODEBUG=asyncpreemptoff=1 (callgrind aborts
# on the signals of Go's asynchronous preemption). Then it is stopped; the
# timed runs below start every contender afresh. The quick mode counts
# infermesh, infermesh-info, nginx and infermesh-before only, over fewer
# requests.
INSTR_N=2000
[ "$QUICK" = 1 ] && INSTR_N=300
INSTR_N=${BENCH_INSTR_N:-$INSTR_N}
INSTR=()
count_instructions() {
  local c=$1 first=${#PIDS[@]} pids p total i t0
  t0=$(date +%s.%N)
  mkdir -p "$WORK/cg"
  # cpu.rdtscp=off: Go's runtime.cputicks uses RDTSCP where the CPU has
  # it, which valgrind 3.19 cannot decode (SIGILL); RDTSC is the same count.
  WRAP=(env GODEBUG=asyncpreemptoff=1,cpu.rdtscp=off valgrind --tool=callgrind --trace-children=yes "--callgrind-out-file=$WORK/cg/%p.out")
  WAIT_TRIES=1200
  "contender_$c"
  WRAP=() WAIT_TRIES=100
  IFS=, read -ra pids <<<"$LAST_PIDS"
  "$LOADGEN" -fixed 200 -addr "$LAST_ADDR" -model "$LAST_MODEL" || die "instructions: $c: warm-up failed"
  local name=${ENTRIES[-1]#*\"name\":\"} logged0 logged=0
  name=${name%%\"*}
  logged0=$(access_lines "$name")
  for p in "${pids[@]}"; do callgrind_control -z "$p" >/dev/null 2>&1 || die "instructions: callgrind_control -z $p ($c) failed"; done
  "$LOADGEN" -fixed "$INSTR_N" -addr "$LAST_ADDR" -model "$LAST_MODEL" || die "instructions: $c: requests failed"
  for p in "${pids[@]}"; do callgrind_control -d "$p" >/dev/null 2>&1 || die "instructions: callgrind_control -d $p ($c) failed"; done
  logged=$(($(access_lines "$name") - logged0))
  total=0
  for p in "${pids[@]}"; do
    total=$((total + $(awk '/^totals:/ {s += $2} END {print s + 0}' "$WORK/cg/$p.out".*)))
  done
  for ((i = first; i < ${#PIDS[@]}; i++)); do kill "${PIDS[$i]}" 2>/dev/null || true; done
  for ((i = first; i < ${#PIDS[@]}; i++)); do wait "${PIDS[$i]}" 2>/dev/null || true; done
  PIDS=("${PIDS[@]:0:first}")
  if [ "${BENCH_KEEP:-0}" = 1 ]; then mv "$WORK/cg" "$WORK/cg-$c"; else rm -rf "$WORK/cg"; fi
  INSTR+=("$(printf '{"name":"%s","requests":%d,"instructions":%d,"logged":%d}' "$name" "$INSTR_N" "$total" "$logged")")
  log "instructions: $name: $total for $INSTR_N requests ($logged access-log lines)"
  phase_done "instructions $name" "$t0"
}
# access_lines <contender>: the access-log lines in its log so far (zap's
# sampler writes the first 100 a second of a message, then 1 in 100).
access_lines() { grep -c '"logger":"access"' "$WORK/$1.log" 2>/dev/null || true; }
if command -v valgrind >/dev/null && command -v callgrind_control >/dev/null; then
  for c in ${BENCH_INSTR_ONLY:-${CONTENDERS[@]} ${INSTR_EXTRA[@]}}; do
    [ "$c" = direct ] && continue
    # The quick mode counts the local path (at warn and at info) and nginx
    # only (and the build compared with, under BENCH_COMPARE).
    [ "$QUICK" = 1 ] && [[ " infermesh infermesh_info nginx infermesh_before " != *" $c "* ]] && continue
    log "counting instructions: $c (callgrind, $INSTR_N requests)"
    count_instructions "$c"
  done
else
  log "warning: valgrind not installed; no instruction counts"
fi
ENTRIES=()
(
  IFS=,
  echo "[${INSTR[*]}]"
) >"$WORK/instructions.json"
[ -z "${BENCH_INSTR_ONLY:-}" ] || exit 0

ROUTING_ARGS=()
if [ "${BENCH_SKIP_ROUTING:-0}" != 1 ]; then
  routing_phase -routing-out "$WORK/routing.json"
  ROUTING_ARGS=(-routing-results "$WORK/routing.json")
fi

T0=$(date +%s.%N)
for c in "${CONTENDERS[@]}"; do
  log "starting contender $c"
  "contender_$c"
done
phase_done "contenders started" "$T0"
(
  IFS=,
  echo "[${ENTRIES[*]}]"
) >"$WORK/contenders.json"

META=$(printf '{"nginx":"%s","haproxy":"%s","commit":"%s","kernel":"%s","udp quic":"%s"}' \
  "$(nginx -v 2>&1 | sed 's|.*/||')" "$(haproxy -v | head -1 | awk '{print $3}')" \
  "$(git describe --always --dirty 2>/dev/null || echo unknown)" "$(uname -r)" "${QUIC_SOCKET:-not run}")

(
  IFS=,
  printf '{"started":%d,"loadavg_start":"%s","phases":[%s]}\n' "$RUN_STARTED" "$LOAD_START" "${PHASES[*]}"
) >"$WORK/harness.json"

log "running the load generator"
# shellcheck disable=SC2086
"$LOADGEN" -contenders "$WORK/contenders.json" -instructions "$WORK/instructions.json" -harness "$WORK/harness.json" -out bench/results $LOADGEN_MODE -meta "$META" "${ROUTING_ARGS[@]}" \
  -stream-tokens "$STREAM_TOKENS" -stream-delay "$STREAM_DELAY" \
  -many-tokens "$MANY_TOKENS" -many-delay "$MANY_DELAY" ${BENCH_ARGS:-}

# Every contender must still be alive: a crash mid-run is a broken harness.
for pid in "${PIDS[@]}"; do
  kill -0 "$pid" 2>/dev/null || die "process $pid exited during the run (see $WORK/*.log)"
done
