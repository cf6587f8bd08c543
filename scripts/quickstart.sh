#!/usr/bin/env bash
# Fresh machine -> installed package, bundled model, a running server and one compressed request:
# a ~1500-token chat prompt with `X-KV-Compression: policy=lagkv; ratio=0.25; lag=128; sink=16`;
# prints the answer, the applied spec and the KV blocks freed, then stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m vllm_kvcomp model fetch

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG=$(mktemp -t vllm-kvcomp-quickstart.XXXXXX.log)
echo "starting the server on 127.0.0.1:${PORT} (log: ${LOG})"
setsid python3 -m vllm_kvcomp serve --host 127.0.0.1 --port "${PORT}" >"${LOG}" 2>&1 &
SERVER=$!
trap 'kill -- -"${SERVER}" 2>/dev/null || true; wait "${SERVER}" 2>/dev/null || true' EXIT

for _ in $(seq 600); do
  if curl -sf "http://127.0.0.1:${PORT}/health" >/dev/null; then break; fi
  if ! kill -0 "${SERVER}" 2>/dev/null; then tail -n 50 "${LOG}"; echo "the server exited" >&2; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:${PORT}/health" >/dev/null || { tail -n 50 "${LOG}"; echo "no /health after 600 s" >&2; exit 1; }

python3 - "${PORT}" <<'PY'
import sys

from openai import OpenAI

HEADER = "policy=lagkv; ratio=0.25; lag=128; sink=16"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
prompt = (
    "There is an important piece of information hidden in a lot of text. Find it and remember it.\n"
    + FILLER * 5 + "\nThe pass key is 71432. Remember it. 71432 is the pass key.\n" + FILLER * 55
    + "\nWhat is the pass key? Answer with the number only."
)
client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")


def ask(header: str):
    raw = client.chat.completions.with_raw_response.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
        max_tokens=16, temperature=0, extra_headers={"X-KV-Compression": header},
    )
    reply = raw.parse()
    return reply.choices[0].message.content.strip(), raw.headers["X-KV-Compression-Applied"], \
        reply.usage.model_extra["kv_compression"]


full_answer, _, _ = ask("none")
answer, applied, kv = ask(HEADER)
print(f"request   : X-KV-Compression: {HEADER}  (the pass key is 71432)")
print(f"answer    : {answer!r}  (uncompressed: {full_answer!r})")
print(f"applied   : {applied}")
print(f"prompt    : {kv['prompt_tokens']} tokens; kept {kv['tokens_kept']} per KV head on average "
      f"(largest head {kv['kept_max_head']}; {kv['kept_fraction']:.1%} of the full cache), "
      f"evicted {kv['tokens_evicted']} (layer, head, token) entries")
print(f"freed     : {kv['blocks_freed']} KV blocks returned to the pool early; "
      f"compression took {1000 * kv['compression_seconds']:.1f} ms")
PY
