"""A serving configuration as a file (`ouro tune --output tuned.toml`, then `ouro serve --config
tuned.toml`, `LLM(config=...)`, `ouro bench offline --config ...`).

The file is TOML with one table, `[engine]`, of `EngineConfig` field names; a `[tune]` table (what
`ouro tune` measured) and comments are ignored here. Flags given on the command line, and keyword
arguments given to `LLM`, override the file's values.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from .engine import EngineConfig

# the EngineConfig fields a file may set, and the `ouro serve` flag (argparse dest) of each
FLAGS = {"dtype": "dtype", "page_size": "page_size", "max_num_seqs": "max_num_seqs",
         "max_num_batched_tokens": "max_num_batched_tokens", "compile": "compile",
         "torch_compile_max_bs": "torch_compile_max_bs", "quantization": "quantization",
         "kv_cache_dtype": "kv_cache_dtype", "kv_cache_layer_dtype": "kv_cache_layer_dtype",
         "speculative_algorithm": "speculative_algorithm", "speculative_num_steps": "speculative_num_steps",
         "tensor_parallel_size": "tp", "expert_parallel": "ep", "quantization_ignore": "quantization_ignore",
         "enable_prefix_caching": "enable_prefix_caching", "prefix_checkpoint_interval": "prefix_checkpoint_interval"}


def load_config_file(path) -> dict:
    """The `[engine]` table as EngineConfig fields, checked (an unknown key or a bad value names it)."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {p} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:          # a directory, no permission, ...
        raise ValueError(f"config file {p} cannot be read: {e.strerror or e}") from None
    # a key outside the two tables (`compile = true` on the file's first lines, a misspelt table) would
    # otherwise be dropped without a word, and the engine run without it
    stray = sorted(k for k in doc if k not in ("engine", "tune") or not isinstance(doc[k], dict))
    if stray:
        raise ValueError(f"config file {p}: {stray} outside the [engine] and [tune] tables; "
                         f"engine settings go under an [engine] line, e.g. [engine] then compile = true")
    fields = doc.get("engine", {})
    unknown = sorted(set(fields) - set(FLAGS))
    if unknown:
        raise ValueError(f"config file {p}: unknown [engine] keys {unknown}; known: {', '.join(sorted(FLAGS))}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}   # TOML arrays
    EngineConfig(**fields)          # validates every value, naming the field
    return dict(fields)


def _toml_value(v) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config_file(path, fields: dict, comment: str = "", extra: dict | None = None) -> None:
    """Write `fields` (EngineConfig fields, None values left out) as `[engine]`; `extra` as `[tune]`."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(fields) - set(FLAGS))
    if unknown:
        raise ValueError(f"not settable from a config file: {unknown}")
    lines = [f"# {line}" for line in comment.splitlines()] + ["[engine]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(fields.items()) if v is not None and k in defaults]
    if extra:
        lines += ["", "[tune]"] + [f"{k} = {_toml_value(v)}" for k, v in sorted(extra.items()) if v is not None]
    Path(path).write_text("\n".join(lines) + "\n")


def apply_to_args(args, argv: list[str], parser, fields: dict) -> None:
    """`ouro serve --config FILE`: each file value becomes the flag's value unless the flag was
    given on the command line (`argv`); `parser` is the subcommand's (its option strings)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    by_dest = {a.dest: a for a in parser._actions}
    for field, value in fields.items():
        dest = FLAGS[field]
        action = by_dest.get(dest)
        if action is None or given & set(action.option_strings):
            continue
        if field == "expert_parallel":        # --ep N: N = --tp when on
            value = fields.get("tensor_parallel_size", getattr(args, "tp", 1)) if value else 1
        if field == "quantization_ignore":    # the flag's form: comma-separated patterns
            value = ",".join(value)
        setattr(args, dest, value)
