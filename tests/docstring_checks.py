"""Checks that public names carry Google-style docstrings (shared by the core and adapter tests)."""

import dataclasses
import inspect


def public_callables(module):
    """``(qualified name, object)`` for every public name of ``module`` and its public methods."""
    for name in module.__all__:
        obj = getattr(module, name)
        yield name, obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") and attr not in ("__init__", "__call__"):
                    continue
                member = getattr(member, "__func__", member)
                generated = attr == "__init__" and dataclasses.is_dataclass(obj)
                if inspect.isfunction(member) and not generated:
                    yield f"{name}.{attr}", member


def sections(doc):
    return {line.strip() for line in doc.splitlines() if line.strip().endswith(":")}


def check_google_docstring(name, obj):
    """Asserts a docstring, and for functions Args / Returns / Raises where they apply."""
    doc = inspect.getdoc(obj)
    assert doc and doc.strip(), f"{name} has no docstring"
    if dataclasses.is_dataclass(obj):
        assert "Attributes:" in sections(doc), f"{name} documents no Attributes"
        for field in dataclasses.fields(obj):
            assert f"  {field.name}:" in doc, f"{name} does not document {field.name}"
    if not inspect.isfunction(obj):
        return
    params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
    found = sections(doc)
    if params:
        assert "Args:" in found, f"{name} documents no Args"
        for param in params:
            assert param in doc, f"{name} does not document {param}"
    annotation = inspect.signature(obj).return_annotation
    if obj.__name__ != "__init__" and annotation not in (None, "None", inspect.Signature.empty):
        assert found & {"Returns:", "Yields:"}, f"{name} documents no Returns"
    if "raise " in inspect.getsource(obj):
        assert "Raises:" in found, f"{name} raises but documents no Raises"
