"""The flat view of the configuration tree: CLI flags and Serve arguments, derived, never declared.

Every field of config.py's tree gets one flat name (`tree_nodes`, `retrieval_top_k`,
`draft_prefill_window`, ...). `flat_fields(AppConfig)` lists them with their pydantic FieldInfo
(type, range, default, help), `flat_model` builds the pydantic model that validates a flat dict
(errors name the flat field), `add_arguments` adds argparse flags (`--tree-nodes`) for the same
fields, and `nest` turns flat values back into the tree. As vLLM derives its CLI from its config
dataclasses, a new setting is added in config.py only.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

# settings that existed once; passing one fails with what replaced it
REMOVED = {
    "cuda_graphs": "removed: the execution plan is one setting, execution=auto|graphs|eager",
    "full_graphs": "removed: the execution plan is one setting, execution=auto|graphs|eager",
    "torch_compile": "removed: the production plan uses the Triton kernels (execution=graphs)",
    "draft_pipeline": "replaced by draft_overlap",
}


@dataclass(frozen=True)
class FlatField:
    name: str  # flat name, e.g. tree_nodes
    path: tuple[str, ...]  # attribute path in the tree, e.g. ("engine", "tree", "nodes")
    info: FieldInfo
    surfaces: tuple[str, ...]  # where it appears: "cli", "serve"


def _is_config(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and hasattr(tp, "__pydantic_fields__")


def flat_fields(cls: type, prefix: str = "", path: tuple[str, ...] = (),
                surfaces: tuple[str, ...] = ("cli", "serve")) -> list[FlatField]:
    out = []
    for name, info in cls.__pydantic_fields__.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if _is_config(info.annotation):
            sub = extra.get("prefix", f"{name}_")
            out += flat_fields(info.annotation, prefix + sub, path + (name,),
                               tuple(extra.get("surfaces", surfaces)))
            continue
        out.append(FlatField(extra.get("flat", prefix + name), path + (name,), info,
                             tuple(extra.get("surfaces", surfaces))))
    return out


def nest(fields: list[FlatField], values: dict[str, Any]) -> dict:
    """Flat values -> nested dicts along each field's path (fields not given are left out)."""
    tree: dict = {}
    for f in fields:
        if f.name in values:
            node = tree
            for key in f.path[:-1]:
                node = node.setdefault(key, {})
            node[f.path[-1]] = values[f.name]
    return tree


class FlatSettings(BaseModel):
    """Base of the generated flat models: validates the flat values, then builds the tree once
    (the tree's own cross-field checks run here, so errors surface at the boundary)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    _root: typing.ClassVar[type]
    _fields: typing.ClassVar[list[FlatField]]

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key in REMOVED:
                    raise ValueError(f"{key}: {REMOVED[key]}")
        return data

    @model_validator(mode="after")
    def _check_tree(self) -> "FlatSettings":
        self.to_config()
        return self

    def to_config(self):
        given = {f.name: getattr(self, f.name) for f in self._fields}
        return self._root(**nest(self._fields, given))


def flat_model(name: str, root: type, surface: str, base: type[FlatSettings] = FlatSettings) -> type[FlatSettings]:
    fields = [f for f in flat_fields(root) if surface in f.surfaces]
    model = create_model(name, __base__=base, __module__=base.__module__,
                         **{f.name: (f.info.annotation, f.info) for f in fields})
    model._root, model._fields = root, fields
    return model


def error_line(err: ValidationError) -> str:
    """One line naming each bad field (CLI output)."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


# ------------------------------------------------------------------ argparse

def _base_type(annotation: Any) -> Any:
    """Optional[X] -> X."""
    if typing.get_origin(annotation) is Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_arguments(parser: argparse.ArgumentParser, model: type[FlatSettings]) -> None:
    """One flag per flat field (`--tree-nodes`); the default None means "the schema's default"."""
    for f in model._fields:
        tp = _base_type(f.info.annotation)
        flag = "--" + f.name.replace("_", "-")
        default = f.info.get_default(call_default_factory=True)
        help_ = (f.info.description or "") + ("" if default is None else f" (default: {default})")
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(tp) is Literal:
            parser.add_argument(flag, dest=f.name, choices=typing.get_args(tp), default=None, help=help_)
        else:
            parser.add_argument(flag, dest=f.name, type=tp, default=None, help=help_)


def from_arguments(model: type[FlatSettings], ns: argparse.Namespace) -> FlatSettings:
    """The flags that were given, validated; raises ValidationError."""
    given = {f.name: getattr(ns, f.name) for f in model._fields if getattr(ns, f.name, None) is not None}
    return model.model_validate(given)

