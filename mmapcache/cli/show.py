"""``mmapcache inspect`` and ``mmapcache ls``: a cache described, and the caches of a directory listed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .args import Add, existing_dir

__all__ = ["register"]


def register(add: Add) -> None:
    """Adds this module's subcommands (``add`` makes a subparser: name, help, example, description)."""
    p = add("inspect", "describe a cache", "mmapcache inspect imagenet-224 --json | jq .fraction")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(run=_cmd_inspect)

    p = add("ls", "list the caches in a directory", "mmapcache ls /dev/shm/mmapcache")
    p.add_argument("dir", nargs="?", metavar="DIR", help="default: $MMAPCACHE_DIR or /dev/shm/mmapcache")
    p.add_argument("--json", action="store_true", help="a JSON list")
    p.set_defaults(run=_cmd_ls)



def _cmd_inspect(args: argparse.Namespace) -> int:
    from .. import describe

    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(_render(info))
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from .. import list_caches

    directory = existing_dir(args.dir)
    entries = list_caches(directory)
    if args.json:
        print(json.dumps(entries, indent=1))
    elif entries:
        print(_render_list(entries))
    else:
        print(f"no caches in {directory}", file=sys.stderr)
    return 0


def _render(info: dict[str, Any]) -> str:
    """``describe``'s result as aligned text lines."""
    slots = f"{info['slots']} of {info['length']} ({100 * info['slot_fraction']:.1f}%)"
    fields = [_render_field(f) for f in info["fields"]]
    users = ", ".join(map(str, info["users"])) or "none"
    lines = [
        ("path", info["path"]),
        ("format", f"version {info['format_version']} (written by mmapcache {info['library_version']})"),
        ("length", str(info["length"])),
        *([("cacheable", slots)] if info.get("mode") != "stream" else []),
        *([("share", info["share"]["text"])] if info.get("share") else []),
        *(_stream_lines(info["stream"]) if info.get("stream") else []),
        ("variants", str(info["variants"])),
        ("filled", f"{info['filled']} of {info['rows']} rows ({100 * info['fraction']:.1f}%)"),
        ("stale", str(info["stale"])),
        ("size", f"{info['size']} on disk, {info['free']} free on its file system"),
        ("fingerprint", str(info["fingerprint"])),
        ("created", str(info["created"])),
        ("users", users),
        ("fields", fields[0] if fields else ""),
    ]
    width = max(len(k) for k, _ in lines) + 1
    text = [f"{k + ':':<{width}} {v}" for k, v in lines]
    text += [f"{'':<{width}} {f}" for f in fields[1:]]
    if info.get("mode") != "stream":  # a stream's rows hold positions of its order: no map by index
        text.append(f"{'fill map:':<{width}} |{info['fill_map']}|  (index 0 ... {info['length'] - 1})")
        text.append(f"{'':<{width}} one character per range of indices: ' ' empty, '.:-=+*#%' partly filled (more to "
                    "the right), '@' full, '_' not cacheable")
    return "\n".join(text)


def _stream_lines(stream: dict[str, Any]) -> list[tuple[str, str]]:
    readers = ", ".join(f"local rank {rank} at epoch {epoch} position {k}"
                        for rank, (epoch, k) in stream["readers"].items())
    producers = ", ".join(map(str, stream["producers"])) or "none running"
    return [
        ("stream", f"seed {stream['seed']}, a ring of {stream['slots']} samples; {stream['ahead']} ready ahead of the "
                   "slowest reader"),
        ("node", stream["split_text"]),
        ("produced", f"{stream['produced']} ({stream['skipped']} too late for their reader); served "
                     f"{stream['served']} fresh from the ring, {stream['computed']} computed by readers, "
                     f"{stream['waited']:.1f} s waited"),
        ("producers", producers),
        ("readers", readers or "none yet"),
    ]


def _render_field(field: dict[str, Any]) -> str:
    if field["kind"] == "json":  # a tensor subclass's attributes, a field of their own
        return f"{field['name']}: the attributes of {field['name'].removesuffix('#meta')!r} (JSON, ragged)"
    shape = "x".join("*" if d < 0 else str(d) for d in field["shape"]) or "scalar"
    text = f"{field['name']}: {field['kind']} {field['dtype']} {shape}"
    if field["variable"]:
        text += " (max, variable)"
    heap = field.get("heap")
    if heap is not None:
        stored = field.get("stored")
        how = "" if stored is None else "all ones, only shapes stored; " if stored == "ones" else \
            f"stored as {stored}; "
        text += f" (ragged: {how}{heap['text']}; {field.get('elements', 0):,} elements in filled rows)"
    return text


def _render_list(entries: list[dict[str, Any]]) -> str:
    """``list_caches``'s result as an aligned table."""
    # CACHEABLE: the share of samples the cache can hold (max_bytes/cache_indices); FILLED: the share of those
    # (all their variants) already stored. A full partial cache reads "76.6%  100.0%", never a bare "100.0%". A
    # stream holds no sample for good: a ring of fresh samples, FILLED its slots holding one now.
    table = [("NAME", "LENGTH", "CACHEABLE", "FILLED", "SIZE", "USERS")]
    for e in entries:
        users = ",".join(map(str, e["users"])) or "-"
        if "error" in e:
            table.append((e["name"], "?", "-", "damaged", e["size"], users))
        elif e["mode"] == "stream":
            table.append((e["name"], str(e["length"]), f"stream: ring of {e['slots']}", f"{100 * e['fraction']:.1f}%",
                          e["size"], users))
        else:
            table.append((e["name"], str(e["length"]), f"{100 * e['cacheable']:.1f}%", f"{100 * e['fraction']:.1f}%",
                          e["size"], users))
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:-1], widths[1:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
