#!/usr/bin/env bash
# A swarm across network namespaces, one per host, with shaped links:
#
#   hub namespace: a bridge (10.77.0.1/24) and the bootstrap peer
#   node i:        its own namespace, a veth pair to the bridge, 10.77.0.(10+i)
#                  upload (egress of the node's end)  = tbf UP,   default 10 Mbit/s
#                  download (egress of the hub's end) = tbf DOWN, default 100 Mbit/s
#                  the last node is SLOW× slower both ways (the degrade case)
#
# Usage: scripts/netns-swarm.sh SWARM_BIN OUT_DIR [NODES=4] [STEPS=10] [PERIOD_MS=2000]
# Writes OUT_DIR/n$i.jsonl (the nodes' --status lines), n$i.log, run.toml, links.txt.
# RELAY=1: the bootstrap peer (in the hub, unshaped) is the run's relay (`bootstrap --run
# --relay`, status in OUT_DIR/boot.jsonl) and the nodes use a lean gossip mesh (`--mesh 2`).
# Prints "SKIP: why" and exits 0 where namespaces cannot be made (not root, no ip/tc, no
# permission). Everything it creates is removed on exit, however it exits.
set -u
BIN=${1:?swarm binary}
OUT=${2:?output directory}
NODES=${3:-4}
STEPS=${4:-10}
PERIOD=${5:-2000}
UP=${UP:-10mbit}
DOWN=${DOWN:-100mbit}
SLOW=${SLOW:-10}
RELAY=${RELAY:-0}
TAG=sw$$
HUB=$TAG-hub

skip() { echo "SKIP: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "not root"
command -v ip >/dev/null || skip "no ip(8)"
command -v tc >/dev/null || skip "no tc(8)"
ip netns add "$HUB" 2>/dev/null || skip "ip netns add: not permitted here"

PIDS=()
cleanup() {
    # Keep the script's own exit status: nothing in here may fail the run.
    local rc=$?
    set +e
    for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
    wait 2>/dev/null
    for i in $(seq 0 $((NODES - 1))); do ip netns del "$TAG-n$i" 2>/dev/null; done
    ip netns del "$HUB" 2>/dev/null
    exit $rc
}
trap cleanup EXIT INT TERM

set -e
mkdir -p "$OUT"
rate() { # "10mbit" / k → "1mbit" (tc understands kbit too)
    local v=${1%mbit}; echo "$(( v * 1000 / $2 ))kbit"
}
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" addr add 10.77.0.1/24 dev br0
ip -n "$HUB" link set br0 up
: > "$OUT/links.txt"
for i in $(seq 0 $((NODES - 1))); do
    ns=$TAG-n$i
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip link add "v$TAG$i" netns "$ns" type veth peer name "h$TAG$i" netns "$HUB"
    ip -n "$ns" link set "v$TAG$i" name eth0
    ip -n "$ns" addr add "10.77.0.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$HUB" link set "h$TAG$i" master br0
    ip -n "$HUB" link set "h$TAG$i" up
    up=$UP; down=$DOWN
    if [ "$i" = $((NODES - 1)) ]; then up=$(rate "$UP" "$SLOW"); down=$(rate "$DOWN" "$SLOW"); fi
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$up" burst 32kbit latency 200ms
    ip netns exec "$HUB" tc qdisc add dev "h$TAG$i" root tbf rate "$down" burst 32kbit latency 200ms
    echo "n$i 10.77.0.$((10 + i)) up $up down $down" >> "$OUT/links.txt"
done

# Step 0 starts once every node is up: 15 s leaves room for five processes loading libtorch
# on a busy 2-core machine (at 8 s the slow host once came up after step 0 was applied and,
# on its 10x slower link, could not fetch a checkpoint within a period: a red drill).
GENESIS=$(( $(date +%s%3N) + 15000 ))
sed -e "s/^period_ms = .*/period_ms = $PERIOD/" \
    -e "s/^grace_ms = .*/grace_ms = $((PERIOD * 4 / 25))/" \
    -e "s/^summary_ms = .*/summary_ms = $((PERIOD * 8 / 25))/" \
    -e "s/^genesis_ms = .*/genesis_ms = $GENESIS/" \
    "$(dirname "$0")/../node/runs/tiny-local.toml" > "$OUT/run.toml"
BOOT_ARGS=()
MESH=()
if [ "$RELAY" = 1 ]; then
    BOOT_ARGS=(--run "$OUT/run.toml" --relay --steps "$STEPS" --status "$OUT/boot.jsonl")
    MESH=(--mesh 2)
fi
"$BIN" keygen --out "$OUT/boot.key" >/dev/null 2>&1
ip netns exec "$HUB" "$BIN" bootstrap --listen /ip4/10.77.0.1/tcp/4001 --key "$OUT/boot.key" \
    --addr-file "$OUT/boot.addr" "${BOOT_ARGS[@]}" >/dev/null 2>"$OUT/boot.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$OUT/boot.addr" ] && break; sleep 0.1; done
BOOT=$(head -n1 "$OUT/boot.addr")
[ -n "$BOOT" ] || { echo "bootstrap did not start"; cat "$OUT/boot.log"; exit 1; }

for i in $(seq 0 $((NODES - 1))); do
    "$BIN" keygen --out "$OUT/n$i.key" >/dev/null 2>&1
    ip netns exec "$TAG-n$i" "$BIN" run --run "$OUT/run.toml" --key "$OUT/n$i.key" \
        --bootstrap "$BOOT" --listen "/ip4/10.77.0.$((10 + i))/tcp/0" --device cpu --threads 1 \
        --steps "$STEPS" --status "$OUT/n$i.jsonl" "${MESH[@]}" >/dev/null 2>"$OUT/n$i.log" &
    PIDS+=($!)
done
echo "genesis_ms $GENESIS period_ms $PERIOD nodes $NODES steps $STEPS" > "$OUT/meta.txt"
# The nodes leave by themselves after STEPS steps; a generous deadline beyond that.
deadline=$(( $(date +%s) + 15 + STEPS * PERIOD / 1000 + 40 ))
for p in "${PIDS[@]:1}"; do
    while kill -0 "$p" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
done
echo "done: $OUT"
