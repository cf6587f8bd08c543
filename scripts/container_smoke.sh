#!/usr/bin/env bash
# Build the CPU image (deploy/docker/Dockerfile.cpu, unchanged: only build arguments differ),
# run it with podman and check that it serves compressed requests:
#
#   [1/10] tools: podman, runc, debootstrap, curl (installed with apt-get when missing and root)
#   [2/10] base image: Debian bookworm + Python 3.11 from the machine's Debian mirror, as a
#          local stand-in for python:3.11-slim-bookworm (no image registry is reachable here);
#          built once, then reused
#   [3/10] package index: the machine's pip settings (index, extra indexes, find-links, CA
#          bundle) turned into the Dockerfile's PIP_* build arguments + read-only mounts
#   [4/10] build the CPU image (time and size reported)
#   [5/10] image: entrypoint, exposed port, health check, non-root user, no build leftovers
#   [6/10] run it; wait for /health
#   [7/10] running container: server process, user, model path, the image's own HEALTHCHECK
#   [8/10] one chat request per policy in POLICIES: HTTP 200, X-KV-Compression-Applied,
#          usage.kv_compression (the request really compressed)
#   [9/10] /metrics: vllm:kvcomp_* series for every policy served
#   [10/10] stop and remove the container
#
# Usage: bash scripts/container_smoke.sh [--no-cache] [--rebuild-base] [--report FILE]
#   --no-cache      build the CPU image without podman's layer cache (a cold build; buildah
#                   keeps no cache from it either, so the next build is cold too)
#   --rebuild-base  rebuild the local base image even if it exists
#   --report FILE   also write the step lines and the summary to FILE; the summary records a
#                   digest of deploy/docker/*, .dockerignore and this script. The committed
#                   report is docs/results/container_smoke.txt; tests/deploy checks that it is a
#                   complete pass and warns when it is stale. Re-make it after changing them:
#                   bash scripts/container_smoke.sh --no-cache --report docs/results/container_smoke.txt
# Environment: KVCOMP_SMOKE_IMAGE, KVCOMP_SMOKE_BASE_IMAGE (image names),
#   KVCOMP_SMOKE_DEBIAN_MIRROR (default: read from the apt sources), KVCOMP_SMOKE_TORCH_INDEX
#   (default: the machine's pip index), KVCOMP_SMOKE_HEALTH_TIMEOUT (seconds, default 900).
#
# Exit status 0 only when every check passed; a failure names its step and the reason.
set -euo pipefail

# ---------------------------------------------------------------------------- what it checks
# tests/deploy/test_container_contract.py compares these with the Dockerfiles and the chart.
readonly SERVE_COMMAND="vllm-kvcomp serve"
readonly CONTAINER_PORT=8000
readonly HEALTH_PATH=/health
readonly METRICS_PATH=/metrics
readonly CHAT_PATH=/v1/chat/completions
readonly MODELS_PATH=/v1/models
# vLLM needs ~160 MiB of /dev/shm for its engine <-> worker queue; docker/podman give 64 MiB.
readonly SHM_SIZE=1g
readonly POLICIES=("policy=lagkv; ratio=0.25" "policy=razor; ratio=0.5")

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly ROOT
readonly DOCKERFILE=deploy/docker/Dockerfile.cpu
readonly IMAGE=${KVCOMP_SMOKE_IMAGE:-localhost/vllm-kvcomp:smoke-cpu}
readonly BASE_IMAGE=${KVCOMP_SMOKE_BASE_IMAGE:-localhost/kvcomp-smoke-base:bookworm-python3.11}
readonly HEALTH_TIMEOUT=${KVCOMP_SMOKE_HEALTH_TIMEOUT:-900}
readonly REQUEST_TIMEOUT=600
readonly BUILD_MOUNTS=/mnt/kvcomp-build   # where the machine's pip folders appear in the build
readonly TOTAL_STEPS=10

NO_CACHE=0
REBUILD_BASE=0
REPORT=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --no-cache) NO_CACHE=1 ;;
        --rebuild-base) REBUILD_BASE=1 ;;
        --report) REPORT=${2:?--report needs a file}; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "container_smoke: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

# ---------------------------------------------------------------------------- output helpers
STEP="start"
CONTAINER=""
FAILED=0
STARTED=$(date +%s)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvcomp-smoke.XXXXXX")
readonly WORK
if [[ -n $REPORT ]]; then
    REPORT=$(realpath -m "$REPORT")
    mkdir -p "$(dirname "$REPORT")"
    : >"$REPORT"
fi

say() {  # a line for the terminal and the report
    echo "$*"
    if [[ -n $REPORT ]]; then echo "$*" >>"$REPORT"; fi
}

tell() {  # terminal only: machine-specific details (host names) stay out of the report
    echo "$*"
}

step() {  # step N "what"
    STEP="[$1/$TOTAL_STEPS] $2"
    say ""
    say "$STEP ..."
}

fail() {  # fail "why" [file whose tail helps]
    FAILED=1
    say "FAILED at $STEP: $1"
    if [[ -n ${2:-} && -s $2 ]]; then
        say "---- last lines of $2"
        tail -n 40 "$2" | while IFS= read -r line; do say "    $line"; done
    fi
    exit 1
}

# Filled in as the steps run; the summary shows what was measured, also after a failure.
BUILD_SECONDS="" BUILD_KIND="" SIZE_HUMAN="" SIZE_BYTES="" STARTUP_SECONDS=""
steps_cached="" steps_total=""
STATUS_LINES=()

inputs_digest() {  # sha256 of what this run tests (tests/deploy/test_container_contract.py)
    (cd "$ROOT" && { find deploy/docker -type f; echo .dockerignore; echo scripts/container_smoke.sh; } \
        | LC_ALL=C sort | xargs -d '\n' sha256sum | sha256sum | cut -d' ' -f1)
}

summary() {
    say ""
    say "SUMMARY"
    say "  inputs:           sha256 $(inputs_digest) (deploy/docker/*, .dockerignore, scripts/container_smoke.sh)"
    say "  image:            $IMAGE from $DOCKERFILE (base $BASE_IMAGE)"
    if [[ -n $BUILD_SECONDS ]]; then
        say "  build time:       $BUILD_SECONDS s ($BUILD_KIND; $steps_cached of $steps_total steps from cache)"
        say "  image size:       $SIZE_HUMAN ($SIZE_BYTES bytes)"
    fi
    if [[ -n $STARTUP_SECONDS ]]; then say "  start to $HEALTH_PATH: $STARTUP_SECONDS s"; fi
    local line
    for line in "${STATUS_LINES[@]}"; do say "  $line"; done
    say "  whole run:        $(seconds_since "$STARTED") s"
}

cleanup() {
    local rc=$?
    if [[ -n $CONTAINER ]]; then
        echo "stopping and removing container $CONTAINER"
        podman rm -f -t 10 "$CONTAINER" >/dev/null 2>&1 \
            || echo "warning: could not remove container $CONTAINER (podman rm -f $CONTAINER)" >&2
    fi
    if [[ $rc -ne 0 && $FAILED -eq 0 ]]; then
        say "FAILED at $STEP: a command exited with status $rc (see the output above)"
    fi
    summary
    if [[ $rc -eq 0 ]]; then
        rm -rf "$WORK"
        say "RESULT: PASS"
    else
        say "  logs kept in $WORK"
        say "RESULT: FAIL"
    fi
}
trap cleanup EXIT
trap 'FAILED=1; say "FAILED at $STEP: interrupted (signal)"; exit 130' INT TERM

seconds_since() { echo $(($(date +%s) - $1)); }

# ---------------------------------------------------------------------------- 1: tools
step 1 "checking podman, runc, debootstrap, curl"
missing=()
command -v podman >/dev/null || missing+=(podman)
command -v runc >/dev/null || [[ -x /usr/sbin/runc ]] || missing+=(runc)
command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || missing+=(debootstrap)
command -v curl >/dev/null || missing+=(curl)
command -v python3 >/dev/null || fail "python3 is needed (it parses the pip and apt settings)"
if [[ ${#missing[@]} -gt 0 ]]; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        say "installing missing tools with apt-get: ${missing[*]}"
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
            >"$WORK/apt.log" 2>&1 || fail "apt-get install ${missing[*]} failed" "$WORK/apt.log"
    else
        fail "missing tools: ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}"
    fi
fi
PATH=$PATH:/usr/sbin:/sbin
RUNC=$(command -v runc)
# crun fails on these machines (setrlimit, hybrid cgroups): runc, cgroupfs and the host's ulimits.
export CONTAINERS_CONF="$ROOT/deploy/docker/containers.conf"
RUN_FLAGS=(--runtime "$RUNC" --ulimit host)
podman info >"$WORK/podman-info.txt" 2>&1 \
    || fail "podman cannot start here (podman info failed; CONTAINERS_CONF=$CONTAINERS_CONF)" "$WORK/podman-info.txt"
say "podman $(podman version --format '{{.Client.Version}}'), runtime $RUNC, CONTAINERS_CONF=deploy/docker/containers.conf"

# ---------------------------------------------------------------------------- 2: base image
step 2 "local base image $BASE_IMAGE (Debian bookworm + Python 3.11)"
if [[ $REBUILD_BASE -eq 0 ]] && podman image exists "$BASE_IMAGE"; then
    say "cached: $BASE_IMAGE exists (--rebuild-base rebuilds it)"
else
    [[ $(id -u) -eq 0 ]] || fail "debootstrap needs root to build the base image"
    # The mirror and the suites come from this machine's apt sources, never from this file.
    python3 - "$WORK/sources.list" "${KVCOMP_SMOKE_DEBIAN_MIRROR:-}" >"$WORK/mirror" <<'PY' \
        || fail "no Debian bookworm mirror found in /etc/apt/sources.list{,.d/*}; set KVCOMP_SMOKE_DEBIAN_MIRROR"
import glob, sys
out, override = sys.argv[1], sys.argv[2]
entries = []  # (uri, [suites], [components])
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*"))]:
    try:
        text = open(path).read()
    except OSError:
        continue
    if path.endswith(".list"):
        for line in text.splitlines():
            words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
            if len(words) >= 4 and words[0] == "deb":
                entries.append((words[1], [words[2]], words[3:]))
    elif path.endswith(".sources"):
        for stanza in text.split("\n\n"):
            fields = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith("#"):
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.split()
            if "deb" in fields.get("types", []) and fields.get("enabled", ["yes"]) != ["no"]:
                for uri in fields.get("uris", []):
                    entries.append((uri, fields.get("suites", []), fields.get("components", [])))
bookworm = [(u, [s for s in ss if s.startswith("bookworm")], cs) for u, ss, cs in entries]
bookworm = [(u.rstrip("/"), ss, cs) for u, ss, cs in bookworm if ss and "main" in cs]
mirror = override.rstrip("/") or next((u for u, ss, _ in bookworm if "bookworm" in ss), "")
if not mirror:
    sys.exit(1)
with open(out, "w") as f:
    lines = [f"deb {u} {s} main" for u, ss, _ in bookworm for s in ss] or [f"deb {mirror} bookworm main"]
    f.write("\n".join(dict.fromkeys(lines)) + "\n")
print(mirror)
PY
    mirror=$(<"$WORK/mirror")
    say "debootstrap --variant=minbase bookworm from this machine's Debian mirror (apt sources)"
    tell "  mirror: $mirror"
    t0=$(date +%s)
    rootfs="$WORK/rootfs"
    # python3-dev: the headers python:3.11-slim carries too (torch inductor compiles against them).
    debootstrap --variant=minbase --include=python3,python3-pip,python3-dev,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || fail "debootstrap from $mirror failed" "$WORK/debootstrap.log"
    cp "$WORK/sources.list" "$rootfs/etc/apt/sources.list"
    # Like python:3.11-slim: pip may install into the system Python (no PEP 668 marker).
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --numeric-owner -c . \
        | podman import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
            --message "debootstrap minbase bookworm + python3" - "$BASE_IMAGE" >"$WORK/import.log" 2>&1 \
        || fail "podman import of the debootstrap root filesystem failed" "$WORK/import.log"
    rm -rf "$rootfs"
    say "built $BASE_IMAGE in $(seconds_since "$t0") s"
fi
podman run --rm "${RUN_FLAGS[@]}" "$BASE_IMAGE" python3 -c 'import sys; print(sys.version.split()[0])' \
    >"$WORK/base-run.log" 2>&1 \
    || fail "podman run of the base image failed (runtime $RUNC, cgroups, ulimits?)" "$WORK/base-run.log"
say "podman run works; base image Python $(tail -n 1 "$WORK/base-run.log")"

# ---------------------------------------------------------------------------- 3: pip settings
step 3 "package index for the build (this machine's pip settings)"
python3 - "$BUILD_MOUNTS" "${KVCOMP_SMOKE_TORCH_INDEX:-}" >"$WORK/build-args" <<'PY' \
    || fail "could not read this machine's pip settings (python3 -m pip config list)"
# Prints podman build options, one per line: --build-arg=PIP_...=... and --volume=HOST:BUILD:ro
import ast, os, re, subprocess, sys

mounts_root, torch_index = sys.argv[1], sys.argv[2]
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True,
                         capture_output=True, text=True).stdout
rank = {"global": 0, "download": 1, "install": 1, "wheel": 1, ":env:": 2}
settings = {}
for line in listing.splitlines():
    match = re.match(r"^(:env:|[a-z]+)\.([a-z-]+)=(.*)$", line)
    if match and match.group(1) in rank:
        section, key, value = match.group(1), match.group(2), ast.literal_eval(match.group(3))
        if key not in settings or rank[section] >= settings[key][0]:
            settings[key] = (rank[section], value)
value = {key: v for key, (_, v) in settings.items()}
mounts = {}

def inside(path):
    """The build-time path of a host path (mounted read-only under mounts_root)."""
    path = os.path.realpath(path)
    if path not in mounts:
        name = re.sub(r"[^A-Za-z0-9.]+", "-", path.strip("/")) or "root"
        mounts[path] = f"{mounts_root}/{name}"
    return mounts[path]

def translate(item):
    if item.startswith("file://"):
        path = item[len("file://"):].rstrip("/")
        if os.path.basename(path) == "simple":  # <root>/simple/<project>/ links to ../../<files>
            return "file://" + inside(os.path.dirname(path)) + "/simple"
        return "file://" + inside(path)
    if "://" not in item and os.path.exists(item):
        return inside(item)
    return item

args = {"PIP_INDEX_URL": "https://pypi.org/simple"}  # pip's default, unless configured
for key, name in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                  ("find-links", "PIP_FIND_LINKS")):
    if key in value:
        args[name] = " ".join(translate(item) for item in value[key].split())
if "cert" in value and os.path.isfile(value["cert"]):
    args["PIP_CERT"] = inside(value["cert"])
# PyTorch's CPU index is not reachable here: torch==X+cpu comes from the find-links folder,
# the index is the machine's own.
args["TORCH_INDEX"] = torch_index or args.get("PIP_INDEX_URL", "https://pypi.org/simple")
for name, val in args.items():
    print(f"--build-arg={name}={val}")
for host, build in mounts.items():
    print(f"--volume={host}:{build}:ro")
PY
mapfile -t BUILD_OPTS <"$WORK/build-args"
for opt in "${BUILD_OPTS[@]}"; do say "  $opt"; done

# ---------------------------------------------------------------------------- 4: build
step 4 "building $IMAGE from $DOCKERFILE"
build_flags=(-f "$DOCKERFILE" -t "$IMAGE" --build-arg "PYTHON_IMAGE=$BASE_IMAGE" "${BUILD_OPTS[@]}")
# docker format: the OCI format has no HEALTHCHECK (podman would drop it).
build_flags+=(--format docker --runtime "$RUNC" --pull=never)
if [[ $NO_CACHE -eq 1 ]]; then build_flags+=(--no-cache); fi
say "podman build $(printf '%q ' "${build_flags[@]}"). (log: $WORK/build.log)"
t0=$(date +%s)
(cd "$ROOT" && podman build "${build_flags[@]}" .) >"$WORK/build.log" 2>&1 \
    || fail "podman build failed after $(seconds_since "$t0") s" "$WORK/build.log"
BUILD_SECONDS=$(seconds_since "$t0")
steps_total=$(grep -cE '^(\[[0-9]+/[0-9]+\] )?STEP [0-9]+/' "$WORK/build.log" || true)
steps_cached=$(grep -c '^--> Using cache' "$WORK/build.log" || true)
if [[ $NO_CACHE -eq 1 ]]; then BUILD_KIND="cold (--no-cache)"; else BUILD_KIND="layer cache allowed"; fi
SIZE_BYTES=$(podman image inspect --format '{{.Size}}' "$IMAGE")
SIZE_HUMAN="$(numfmt --to=si --suffix=B --format='%.2f' "$SIZE_BYTES") = $(numfmt --to=iec-i --suffix=B --format='%.2f' "$SIZE_BYTES")"
say "built in $BUILD_SECONDS s ($BUILD_KIND; $steps_cached of $steps_total steps from cache)"
say "image size: $SIZE_HUMAN ($SIZE_BYTES bytes, podman image inspect .Size)"
# Earlier builds of this image left untagged 4 GB images behind: remove those (only this
# Dockerfile's, by its title label; the layers of the current image stay as the build cache).
title=$(sed -n 's/^LABEL org.opencontainers.image.title="\([^"]*\)".*/\1/p' "$ROOT/$DOCKERFILE")
pruned=$(podman image prune -f --filter "label=org.opencontainers.image.title=$title" 2>/dev/null | wc -l || true)
if [[ ${pruned:-0} -gt 0 ]]; then say "removed $pruned untagged images of earlier $title builds"; fi

# ---------------------------------------------------------------------------- 5: image config
step 5 "image configuration and contents"
podman image inspect "$IMAGE" >"$WORK/image.json"
python3 - "$WORK/image.json" "$SERVE_COMMAND" "$CONTAINER_PORT" "$HEALTH_PATH" <<'PY' >"$WORK/config-check" 2>&1 \
    || fail "$(cat "$WORK/config-check")"
import json, sys
(image,) = json.load(open(sys.argv[1]))
config, command, port, health = image["Config"], sys.argv[2].split(), sys.argv[3], sys.argv[4]
problems = []
if config.get("Entrypoint") != command:
    problems.append(f"entrypoint is {config.get('Entrypoint')}, expected {command}")
if f"{port}/tcp" not in (config.get("ExposedPorts") or {}):
    problems.append(f"port {port}/tcp is not exposed ({config.get('ExposedPorts')})")
user = (config.get("User") or "0").split(":")[0]
if not user.isdigit() or int(user) == 0:
    problems.append(f"USER is {config.get('User')!r}: expected a numeric non-root uid")
test = " ".join((image.get("Healthcheck") or config.get("Healthcheck") or {}).get("Test") or [])
if f"127.0.0.1:{port}{health}" not in test:
    problems.append(f"HEALTHCHECK does not probe 127.0.0.1:{port}{health}: {test!r}")
if problems:
    print("; ".join(problems))
    sys.exit(1)
print(user)
PY
IMAGE_UID=$(<"$WORK/config-check")
say "entrypoint [$SERVE_COMMAND], exposes $CONTAINER_PORT/tcp, HEALTHCHECK on $HEALTH_PATH, USER $IMAGE_UID"
# Leftovers a lean runtime image must not carry; g++ must be there (torch inductor needs it).
podman run --rm "${RUN_FLAGS[@]}" --user 0 --entrypoint sh "$IMAGE" -c '
    bad=""
    for p in /root/.cache /home/kvcomp/.cache /tmp/wheels /wheels /src; do
        if [ -e "$p" ]; then bad="$bad $p"; fi
    done
    if [ -n "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -x -e lock -e partial)" ]; then bad="$bad /var/lib/apt/lists/*"; fi
    if ls /var/cache/apt/archives/*.deb >/dev/null 2>&1; then bad="$bad /var/cache/apt/archives/*.deb"; fi
    if [ -n "$bad" ]; then echo "build leftovers in the image:$bad"; exit 1; fi
    command -v g++ >/dev/null || { echo "g++ missing (torch inductor compiles the CPU sampler)"; exit 1; }
    g++ --version | head -n 1
' >"$WORK/contents.log" 2>&1 || fail "$(tail -n 1 "$WORK/contents.log")"
say "no pip cache, wheel folder or apt lists; compiler kept for inductor: $(tail -n 1 "$WORK/contents.log")"

# ---------------------------------------------------------------------------- 6: run
step 6 "running the image and waiting for $HEALTH_PATH (at most $HEALTH_TIMEOUT s)"
CONTAINER="kvcomp-smoke-$$"
podman run -d --name "$CONTAINER" "${RUN_FLAGS[@]}" --shm-size "$SHM_SIZE" -p "127.0.0.1::$CONTAINER_PORT" "$IMAGE" \
    >"$WORK/run.log" 2>&1 || { cat "$WORK/run.log" >>"$WORK/container.log"; fail "podman run failed" "$WORK/run.log"; }
HOST_PORT=$(podman port "$CONTAINER" "$CONTAINER_PORT/tcp" | head -n 1 | sed 's/.*://')
[[ $HOST_PORT =~ ^[0-9]+$ ]] || fail "no host port published for $CONTAINER_PORT/tcp"
BASE="http://127.0.0.1:$HOST_PORT"
say "container $CONTAINER (podman run ${RUN_FLAGS[*]} --shm-size $SHM_SIZE -p 127.0.0.1::$CONTAINER_PORT $IMAGE), $BASE"
t0=$(date +%s)
until curl -fsS -o /dev/null --max-time 5 "$BASE$HEALTH_PATH" 2>/dev/null; do
    state=$(podman inspect --format '{{.State.Status}}' "$CONTAINER" 2>/dev/null || echo gone)
    if [[ $state != running ]]; then
        podman logs "$CONTAINER" >"$WORK/container.log" 2>&1 || true
        fail "the container stopped ($state) before $HEALTH_PATH answered" "$WORK/container.log"
    fi
    if [[ $(seconds_since "$t0") -ge $HEALTH_TIMEOUT ]]; then
        podman logs "$CONTAINER" >"$WORK/container.log" 2>&1 || true
        fail "$HEALTH_PATH did not answer within $HEALTH_TIMEOUT s" "$WORK/container.log"
    fi
    sleep 3
done
STARTUP_SECONDS=$(seconds_since "$t0")
say "$HEALTH_PATH answered 200 after $STARTUP_SECONDS s"

# ---------------------------------------------------------------------------- 7: in the container
step 7 "server process, user, model path and the image's HEALTHCHECK"
podman exec "$CONTAINER" sh -c '
    printf "%s " "$(id -u)"
    awk "/^Uid:/ {printf \"%s \", \$2}" /proc/1/status
    tr "\0" " " </proc/1/cmdline
    echo
' >"$WORK/proc1" 2>&1 || fail "podman exec failed" "$WORK/proc1"
read -r exec_uid server_uid server_cmdline <"$WORK/proc1" || fail "unexpected podman exec output" "$WORK/proc1"
say "server (PID 1): $server_cmdline"
[[ $exec_uid == "$IMAGE_UID" && $server_uid == "$IMAGE_UID" && $server_uid != 0 ]] \
    || fail "the container runs as uid $exec_uid (server uid $server_uid), expected the image's non-root uid $IMAGE_UID"
[[ " $server_cmdline " == *"/${SERVE_COMMAND%% *} ${SERVE_COMMAND#* } "* ]] \
    || fail "PID 1 is not '$SERVE_COMMAND': $server_cmdline"
say "runs as uid $server_uid (non-root), PID 1 is '$SERVE_COMMAND'"
curl -fsS --max-time 30 "$BASE$MODELS_PATH" >"$WORK/models.json" 2>"$WORK/models.err" \
    || fail "GET $MODELS_PATH failed" "$WORK/models.err"
read -r MODEL_ID MODEL_ROOT < <(python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["data"][0]; print(m["id"], m.get("root"))' "$WORK/models.json") \
    || fail "GET $MODELS_PATH returned no model" "$WORK/models.json"
expected_root=$(podman image inspect --format '{{index .Config.Cmd 0}}' "$IMAGE")
[[ $MODEL_ROOT == "$expected_root" ]] \
    || fail "the server loaded $MODEL_ROOT, the image's CMD names $expected_root"
say "serves $MODEL_ID from $MODEL_ROOT (the image's CMD)"
podman healthcheck run "$CONTAINER" >"$WORK/healthcheck.log" 2>&1 \
    || fail "the image's HEALTHCHECK command fails in the container" "$WORK/healthcheck.log"
say "the image's HEALTHCHECK command passes (podman healthcheck run: exit 0)"

# ---------------------------------------------------------------------------- 8: requests
step 8 "one chat request per policy"
# A prompt of ~1000 tokens, so ratio=0.25 really evicts; logprobs make vLLM's CPU sampler
# run its torch.compile'd (inductor, g++) kernel inside the container.
python3 - "$WORK/request.json" "$MODEL_ID" <<'PY'
import json, sys
facts = " ".join(f"Item {i}: the code for box {i} is {(i * 7919) % 1000:03d}." for i in range(1, 81))
body = {"model": sys.argv[2], "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": facts + " What is the code for box 42?"}]}
json.dump(body, open(sys.argv[1], "w"))
PY
SERVED=()           # policies answered 200 with every check passed
REQUEST_FAILURES=()
SERVER_LOG=""       # the container's log, attached unless every failure was a 4xx answer
for spec in "${POLICIES[@]}"; do
    policy=${spec#policy=}; policy=${policy%%;*}
    t0=$(date +%s)
    code=$(curl -sS --max-time "$REQUEST_TIMEOUT" -o "$WORK/$policy.body" -D "$WORK/$policy.headers" \
        -w '%{http_code}' -H 'Content-Type: application/json' -H "X-KV-Compression: $spec" \
        --data @"$WORK/request.json" "$BASE$CHAT_PATH" 2>"$WORK/$policy.err") || code="curl-error"
    seconds=$(seconds_since "$t0")
    applied=$(sed -n 's/^[Xx]-[Kk][Vv]-[Cc]ompression-[Aa]pplied: *//p' "$WORK/$policy.headers" 2>/dev/null | tr -d '\r')
    if [[ $code != 200 ]]; then
        detail=$(head -c 400 "$WORK/$policy.body" 2>/dev/null; cat "$WORK/$policy.err")
        say "  $spec -> HTTP $code in $seconds s: $detail"
        STATUS_LINES+=("$spec -> HTTP $code")
        REQUEST_FAILURES+=("$spec: HTTP $code: $detail")
        if [[ $code != 4[0-9][0-9] ]]; then SERVER_LOG="$WORK/container.log"; fi
        continue
    fi
    python3 - "$WORK/$policy.body" "$policy" "$applied" <<'PY' >"$WORK/$policy.check" 2>&1 || true
import json, sys
body, policy, header = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
ext = body.get("usage", {}).get("kv_compression")
problems = []
if not header:
    problems.append("no X-KV-Compression-Applied header")
elif not header.startswith(f"policy={policy};"):
    problems.append(f"X-KV-Compression-Applied is {header!r}")
if not isinstance(ext, dict):
    problems.append("no usage.kv_compression")
else:
    if ext.get("applied") != header:
        problems.append(f"usage.kv_compression.applied {ext.get('applied')!r} != header {header!r}")
    if ext.get("policy") != policy:
        problems.append(f"usage.kv_compression.policy is {ext.get('policy')!r}")
    if not (ext.get("compressions", 0) >= 1 and ext.get("tokens_evicted", 0) > 0
            and 0 < ext.get("tokens_kept", 0) < ext.get("prompt_tokens", 0)):
        problems.append(f"the request was not compressed: {ext}")
if not body.get("choices") or not body["choices"][0].get("logprobs"):
    problems.append("no logprobs in the answer")
if problems:
    print("PROBLEM " + "; ".join(problems))
else:
    keys = ("prompt_tokens", "tokens_kept", "tokens_evicted", "blocks_freed", "compressions", "kept_fraction")
    print("usage.kv_compression: " + ", ".join(f"{k}={ext[k]}" for k in keys))
    print("answer: " + json.dumps(body["choices"][0]["message"]["content"]))
PY
    if grep -q '^PROBLEM' "$WORK/$policy.check" || ! grep -q '^usage' "$WORK/$policy.check"; then
        say "  $spec -> HTTP 200 in $seconds s, but: $(cat "$WORK/$policy.check")"
        STATUS_LINES+=("$spec -> HTTP 200, X-KV-Compression-Applied: $applied (checks failed)")
        REQUEST_FAILURES+=("$spec: $(head -n 1 "$WORK/$policy.check")")
        SERVER_LOG="$WORK/container.log"
        continue
    fi
    say "  $spec -> HTTP 200 in $seconds s"
    say "    X-KV-Compression-Applied: $applied"
    while IFS= read -r line; do say "    $line"; done <"$WORK/$policy.check"
    SERVED+=("$policy")
    STATUS_LINES+=("$spec -> HTTP 200, X-KV-Compression-Applied: $applied")
done
REQUEST_STEP=$STEP
if [[ ${#REQUEST_FAILURES[@]} -gt 0 ]]; then
    podman logs "$CONTAINER" >"$WORK/container.log" 2>&1 || true
    say "  (${#REQUEST_FAILURES[@]} request(s) failed: the run fails after the metrics and the cleanup)"
fi

# ---------------------------------------------------------------------------- 9: metrics
step 9 "vllm:kvcomp_* series on $METRICS_PATH"
[[ ${#SERVED[@]} -gt 0 ]] || fail "no request was served, so there is nothing to count"
t0=$(date +%s)
while :; do  # vLLM publishes finished-request stats a few seconds late
    curl -fsS --max-time 30 "$BASE$METRICS_PATH" >"$WORK/metrics.txt" 2>"$WORK/metrics.err" \
        || fail "GET $METRICS_PATH failed" "$WORK/metrics.err"
    missing=()
    for p in "${SERVED[@]}"; do
        grep -Eq "^vllm:kvcomp_requests_compressed_total\{[^}]*policy=\"$p\"[^}]*\} [1-9]" "$WORK/metrics.txt" \
            || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && break
    if [[ $(seconds_since "$t0") -ge 60 ]]; then
        grep '^vllm:kvcomp_' "$WORK/metrics.txt" >"$WORK/kvcomp-metrics.txt" || true
        fail "vllm:kvcomp_requests_compressed_total has no count for: ${missing[*]}" "$WORK/kvcomp-metrics.txt"
    fi
    sleep 2
done
grep -E '^vllm:kvcomp_(requests_compressed|blocks_freed|tokens_evicted)_total\{' "$WORK/metrics.txt" \
    | sed -E 's/\{[^}]*policy="([^"]+)"[^}]*\}/{policy="\1"}/' | while IFS= read -r line; do say "  $line"; done
say "  ($(grep -c '^vllm:kvcomp_' "$WORK/metrics.txt") vllm:kvcomp_* samples in all)"

# ---------------------------------------------------------------------------- 10: cleanup
step 10 "stopping and removing the container"
podman rm -f -t 10 "$CONTAINER" >/dev/null 2>&1 || fail "podman rm -f $CONTAINER failed"
CONTAINER=""
podman container exists "kvcomp-smoke-$$" && fail "the container still exists after podman rm"
say "removed"

if [[ ${#REQUEST_FAILURES[@]} -gt 0 ]]; then
    STEP=$REQUEST_STEP
    fail "$(printf '%s\n' "${REQUEST_FAILURES[@]}")" "$SERVER_LOG"
fi
