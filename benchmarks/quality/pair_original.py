"""The original-data twin of a regenerated set, for the "regenerated vs original" ablation.

For every conversation in ``regenerated_conversations.jsonl`` (written by `eyas prepare
--regenerate`), the same conversation from the source with its original answers, cut to the
same number of messages (``--max-turns`` and ``--max-length`` cut regenerated conversations
short), so the two sets differ only in who wrote the assistant turns.

    python pair_original.py --regenerated DIR/regenerated_conversations.jsonl --data sharegpt \
        --max-samples 2500 --out original_conversations.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from eyas.data.formats import Skip, normalize, open_source

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerated", required=True, type=Path)
    ap.add_argument("--data", default="sharegpt", help="The source the regenerated set was prepared from.")
    ap.add_argument("--max-samples", type=int, default=None, help="As given to that prepare.")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    regen = [json.loads(x) for x in a.regenerated.read_text().split("\n") if x.strip()]
    want = {r["id"]: len(r["messages"]) for r in regen}
    found: dict[str, list] = {}
    _info, records = open_source(a.data)
    for n, rec in enumerate(records):
        if a.max_samples is not None and n >= a.max_samples:
            break
        if rec.source_id in want:
            msgs = normalize(rec)
            if not isinstance(msgs, Skip):
                found[rec.source_id] = msgs[: want[rec.source_id]]
    missing = [r["id"] for r in regen if r["id"] not in found]
    if missing:
        raise SystemExit(
            f"{len(missing)} regenerated conversations are not in {a.data} "
            f"(first: {missing[:3]}); give the --data/--max-samples of the regeneration"
        )
    a.out.write_text(
        "".join(json.dumps({"id": r["id"], "messages": found[r["id"]]}, ensure_ascii=False) + "\n" for r in regen)
    )
    print(json.dumps({"conversations": len(regen), "out": str(a.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
