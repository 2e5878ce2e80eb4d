"""Journal events for tests, built from the contract's typed details (never hand-made dicts)."""

from __future__ import annotations

from typing import Optional

from hspmd_elastic.contract import schema


def event(seq: int, type_: str, detail: schema.Detail, node: Optional[str] = "n",
          at: float = 100.0, timings: Optional[dict[str, float]] = None) -> schema.EventRecord:
    """An ``EventRecord`` as a reader gets it from etcd (``new_event_record`` checks the type)."""
    return schema.new_event_record(seq, type_, node, detail, timings or {}, at)


def replan(version: int, previous: Optional[int] = None, reason: str = "",
           devices: int = 2, changes: tuple[schema.PlanChange, ...] = (),
           step: Optional[int] = None) -> schema.ReplanDetail:
    prev = version - 1 if previous is None else previous
    return schema.ReplanDetail(version=version, previous_version=prev, reason=reason,
                               device_count=devices, planner="dp", store_endpoint="h:1",
                               step=step, changes=list(changes))


def done(version: int, from_version: Optional[int] = None, source: str = "bsr",
         bytes_moved: int = 0) -> schema.SwitchDoneDetail:
    frm = version - 1 if from_version is None else from_version
    return schema.SwitchDoneDetail(plan_version=version, from_version=frm, source=source,
                                   bytes_moved=bytes_moved)


def failed(version: int, error: str, from_version: int = 0) -> schema.SwitchFailedDetail:
    return schema.SwitchFailedDetail(plan_version=version, error=error,
                                     from_version=from_version)


def change(kind: str, devices: list[str], reason: str = "", plan_version: int = 0
           ) -> schema.Detail:
    """A leader's change event detail (``failure``, ``join``, ``degrade``, ...)."""
    return schema.change_detail(kind, devices, reason, plan_version)


def make(type_: str, **fields) -> schema.Detail:
    """``type_``'s detail with ``fields`` set and every other required field at a zero value;
    nested ``exits`` / ``changes`` may be given as dicts (missing fields zero too)."""
    import dataclasses
    import typing

    def build(cls, given):
        hints = typing.get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in given:
                values[f.name] = given[f.name]
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                values[f.name] = {int: 0, str: "", bool: False, float: 0.0}.get(hints[f.name])
        return cls(**values)

    cls = schema.EVENT_DETAILS[type_]
    if "exits" in fields:
        fields["exits"] = [build(schema.ExitInfo, e) if isinstance(e, dict) else e
                           for e in fields["exits"]]
    if "changes" in fields:
        fields["changes"] = [build(schema.PlanChange, c) if isinstance(c, dict) else c
                             for c in fields["changes"]]
    return build(cls, fields)
