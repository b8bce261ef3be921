"""``kustomize build`` for the subset of kustomize that deploy/k8s/ uses, so the tests render every overlay
offline (Debian packages no kustomize, and kubectl's built-in one is not installable from a package registry
here).

The subset, with kustomize's semantics (kustomize v5, ``kustomize.config.k8s.io/v1beta1``
``Kustomization``; docs at kubectl.docs.kubernetes.io/references/kustomize/kustomization/):

- ``resources``: YAML files (every document of each) and folders holding a ``kustomization.yaml``, built
  first, in order;
- ``patches``: each a ``path`` to a JSON 6902 patch (a YAML list of ``add``/``replace``/``remove``
  operations; RFC 6902, paths as RFC 6901 JSON pointers, ``-`` appends) with a ``target`` that selects
  resources by ``kind``, ``name`` and optionally ``group``/``version``/``namespace``; a patch that matches no
  resource is an error (kustomize's too);
- ``namespace``: set on every resource of the build;
- ``labels``: each entry's ``pairs`` added to every resource's ``metadata.labels`` of this kustomization's
  build (with ``includeSelectors``/``includeTemplates`` false, their defaults: selectors and pod templates
  untouched).

Anything else in a kustomization (``namePrefix``, generators, strategic-merge patches, ``images``...) raises
:class:`Unsupported`: a manifest that starts using it fails the tests until this renderer learns it. The
output was compared with ``kubectl kustomize`` (kustomize v5.5.0) for every overlay when written: the same
objects, field for field (order of the objects aside).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "patches", "namespace", "labels"}


class Unsupported(Exception):
    """A kustomization field, patch form or operation this renderer does not implement."""


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise Unsupported(f"a JSON pointer starts with '/': {path!r}")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def apply_json6902(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """``obj`` with the RFC 6902 operations applied (add, replace, remove), a new object.

    Raises:
        KeyError, IndexError: a path that does not exist where the operation needs it to.
    """
    out = copy.deepcopy(obj)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if kind not in ("add", "replace", "remove"):
            raise Unsupported(f"JSON patch op {kind!r}")
        if isinstance(node, list):
            if kind == "add":
                node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[int(last)] = copy.deepcopy(op["value"])
            else:
                del node[int(last)]
        else:
            if kind in ("replace", "remove") and last not in node:
                raise KeyError(f"{op['path']}: no such field to {kind}")
            if kind == "remove":
                del node[last]
            else:
                node[last] = copy.deepcopy(op["value"])
    return out


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    meta = obj["metadata"]
    wanted = {"kind": obj["kind"], "name": meta["name"], "group": group, "version": version}
    wanted["namespace"] = meta.get("namespace", "")
    for key, value in target.items():
        if key not in wanted:
            raise Unsupported(f"patch target field {key!r}")
        if wanted[key] != value:
            return False
    return True


def build(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build folder`` prints (in the order they are declared)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    extra = set(spec) - SUPPORTED
    if extra:
        raise Unsupported(f"{folder}: kustomization fields {sorted(extra)}")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            objects += build(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for patch in spec.get("patches", []):
        if set(patch) - {"path", "target"} or "path" not in patch or "target" not in patch:
            raise Unsupported(f"{folder}: patches need a path and a target: {patch}")
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise Unsupported(f"{folder / patch['path']}: only JSON 6902 patches (a list of operations)")
        hits = [i for i, obj in enumerate(objects) if _matches(obj, patch["target"])]
        if not hits:
            raise ValueError(f"{folder}: patch {patch['path']} matches no resource ({patch['target']})")
        for i in hits:
            objects[i] = apply_json6902(objects[i], ops)
    if "namespace" in spec:
        for obj in objects:
            obj["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        if set(entry) - {"pairs"} or entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise Unsupported(f"{folder}: labels other than plain pairs: {entry}")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objects


__all__ = ["Unsupported", "apply_json6902", "build"]
