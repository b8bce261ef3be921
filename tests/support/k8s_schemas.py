"""Custom resources (KEDA, LeaderWorkerSet, prometheus-operator) checked against their own published schemas.

A CustomResourceDefinition carries, per served version, an ``openAPIV3Schema`` (an OpenAPI 3.0 schema object,
a subset of JSON Schema draft 4 with Kubernetes' ``x-kubernetes-*`` extensions). :func:`vendor` takes a CRD
YAML as its project publishes it and keeps only that schema of one version, without the ``description``
texts (they are most of the bytes: the LeaderWorkerSet CRD embeds the whole PodTemplateSpec), as JSON; the
files under ``deploy/k8s/schemas/`` were written by it (``deploy/k8s/schemas/README.md``: sources, versions,
the command). :func:`validator` reads one back as the API server would check a create with kubectl's
default strict field validation:

- an object with ``properties`` and no ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields``
  rejects other fields (the API server prunes them and, with ``fieldValidation=Strict``, kubectl's default
  since 1.27, refuses the object: a misspelt field is an error, not a silent no-op);
- ``x-kubernetes-int-or-string`` accepts an integer or a string (when the schema does not say so itself);
- ``metadata`` is checked by the Kubernetes object schema, not here (a CRD's schema says only ``object``).

Draft 4 is the dialect: OpenAPI 3.0's ``exclusiveMinimum`` is a boolean, as in draft 4.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml


def strip_descriptions(node: Any) -> Any:
    """``node`` without any ``description`` key (a property *named* description is kept)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
            elif key != "description":
                out[key] = strip_descriptions(value)
        return out
    if isinstance(node, list):
        return [strip_descriptions(item) for item in node]
    return node


def vendor(crd_text: str, version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in a CRD YAML, without descriptions, with what identifies it.

    Returns:
        ``{"group", "kind", "version", "schema"}``.

    Raises:
        KeyError: the CRD serves no such version.
    """
    crd = yaml.safe_load(crd_text)
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return {
                "group": crd["spec"]["group"],
                "kind": crd["spec"]["names"]["kind"],
                "version": version,
                "schema": strip_descriptions(served["schema"]["openAPIV3Schema"]),
            }
    raise KeyError(f"{crd['metadata']['name']} serves no version {version}")


def strict(node: Any, top: bool = True) -> Any:
    """``node`` read as the API server checks it (see the module text)."""
    if isinstance(node, list):
        return [strict(item, False) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value, False) if key not in ("properties",) else value for key, value in node.items()}
    if "properties" in node:
        props = dict(node["properties"])
        if top and "metadata" in props:
            props["metadata"] = {"type": "object"}
        out["properties"] = {name: strict(sub, False) for name, sub in props.items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "oneOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


class CustomResources:
    """The vendored schemas of a folder, by ``(apiVersion, kind)``.

    Args:
        folder: holds ``*.json`` files written by :func:`vendor`.
    """

    def __init__(self, folder: Path) -> None:
        self.validators: dict[tuple[str, str], jsonschema.Draft4Validator] = {}
        for path in sorted(folder.glob("*.json")):
            doc = json.loads(path.read_text())
            api_version = f"{doc['group']}/{doc['version']}"
            self.validators[api_version, doc["kind"]] = jsonschema.Draft4Validator(strict(doc["schema"]))

    def knows(self, obj: dict[str, Any]) -> bool:
        """A schema is vendored for this object's apiVersion and kind."""
        return (obj.get("apiVersion"), obj.get("kind")) in self.validators

    def errors(self, obj: dict[str, Any]) -> list[str]:
        """What is wrong with ``obj`` (``path: message`` each; empty: valid).

        Raises:
            KeyError: no schema for its apiVersion and kind.
        """
        validator = self.validators[obj["apiVersion"], obj["kind"]]
        return [
            "/".join(str(p) for p in err.absolute_path) + ": " + err.message
            for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
        ]


def main(argv: list[str]) -> int:
    """``python -m tests.support.k8s_schemas CRD.yaml VERSION > OUT.json``."""
    crd, version = argv
    json.dump(vendor(Path(crd).read_text(), version), sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
