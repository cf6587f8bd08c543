"""Write the operator-config JSON schema into the chart's values.schema.json (``compression``).

Run after changing the operator config or a policy's parameters:
    python deploy/helm/sync_schema.py
    python3 scripts/helm_values_table.py --write    # the chart README's values table
tests/deploy checks that the chart's copy equals ``OperatorConfig.json_schema()`` and that the
README's table is current.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_kvcomp.server.operator_config import OperatorConfig

SCHEMA = Path(__file__).parent / "vllm-kvcomp" / "values.schema.json"


def main() -> None:
    schema = json.loads(SCHEMA.read_text())
    compression = OperatorConfig.json_schema()
    compression["description"] = schema["properties"]["compression"]["description"]
    schema["properties"]["compression"] = compression
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"updated {SCHEMA}")


if __name__ == "__main__":
    main()
