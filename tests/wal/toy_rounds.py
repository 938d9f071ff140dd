"""A toy round-record interpreter: the shape the wire package's real one will have.

A toy round record is b"TOYROUND" + JSON {"body", "head", "sig"}, where body is the JSON of
{"session", "round", "prev"}, head = SHA-256(prev head bytes + body) and sig an Ed25519
signature over the head bytes. Genesis head: 32 zero bytes.
"""

from __future__ import annotations

import hashlib
import json

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PREFIX = b"TOYROUND"
GENESIS = "00" * 32


def make_round(session: str, round_: int, prev: str, key: Ed25519PrivateKey) -> tuple[bytes, str]:
    body = json.dumps({"session": session, "round": round_, "prev": prev}, sort_keys=True)
    head = hashlib.sha256(bytes.fromhex(prev) + body.encode()).hexdigest()
    sig = key.sign(bytes.fromhex(head)).hex()
    return PREFIX + json.dumps({"body": body, "head": head, "sig": sig}).encode(), head


def _parse(payload: bytes) -> tuple[dict, dict] | None:
    if not payload.startswith(PREFIX):
        return None
    outer = json.loads(payload[len(PREFIX) :])
    return outer, json.loads(outer["body"])


class ToyInterpreter:
    name = "toy-round"

    def describe(self, payload: bytes) -> dict | None:
        parsed = _parse(payload)
        if parsed is None:
            return None
        outer, body = parsed
        return {"session": body["session"], "round": body["round"], "head": outer["head"]}

    def check_chain(self, records, pubkeys, snapshot) -> str | None:
        keys = [Ed25519PublicKey.from_public_bytes(k) for k in pubkeys]
        heads: dict[str, str] = json.loads(snapshot.data) if snapshot else {}
        for record in records:
            parsed = _parse(record.payload)
            if parsed is None:
                continue
            outer, body = parsed
            where = f"seq {record.seq}: session {body['session']} round {body['round']}"
            at = heads.get(body["session"], GENESIS)
            if body["prev"] != at:
                return f"{where}: links to head {body['prev'][:12]}, the chain is at {at[:12]}"
            head = hashlib.sha256(bytes.fromhex(at) + outer["body"].encode()).hexdigest()
            if head != outer["head"]:
                return f"{where}: head {outer['head'][:12]} does not hash from its body"
            if keys and not any(_verifies(k, outer["sig"], head) for k in keys):
                return f"{where}: no given public key verifies its signature"
            heads[body["session"]] = head
        return None


def _verifies(key: Ed25519PublicKey, sig: str, head: str) -> bool:
    try:
        key.verify(bytes.fromhex(sig), bytes.fromhex(head))
    except InvalidSignature:
        return False
    return True
