"""server/'s folders stand on one another one way (docs/ARCHITECTURE.md "Servers"): storage/ imports nothing
else of the server, http/ only storage/ and compat.py, parents/ nothing of the wiring on top; and the server
never imports the client. Read from the source (ast), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"

# folder -> what of the server (outside itself) its modules may import: folders end in "/", files are top-level modules
MAY_IMPORT = {
    "storage/": set(),
    "http/": {"storage/", "compat"},
    "parents/": {"storage/", "http/", "compat", "config", "metrics", "events"},
}
WIRING = {"cli", "app", "routes", "services"}  # on top: nothing below imports them


def _module(path: Path) -> str:
    """'storage/store' for server/storage/store.py, 'intake' for server/intake.py."""
    rel = path.relative_to(SERVER).with_suffix("")
    return "/".join(rel.parts)


def _imports(path: Path) -> set[str]:
    """The server modules (as _module names) that one file imports, relative or absolute, anywhere in it."""
    here = path.relative_to(SERVER).parent.parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - (node.level - 1)])
                rest = node.module or ""
            elif node.module == "deltasync.server" or (node.module or "").startswith("deltasync.server."):
                base, rest = [], node.module[len("deltasync.server"):].lstrip(".")
            else:
                continue
            out |= _resolve(base + (rest.split(".") if rest else []), [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("deltasync.server."):
                    out |= _resolve(a.name[len("deltasync.server."):].split("."), [])
    return out


def _resolve(parts: list[str], names: list[str]) -> set[str]:
    target = SERVER.joinpath(*parts)
    if target.with_suffix(".py").is_file():
        return {"/".join(parts)}
    if target.is_dir():  # "from .http import uploadrecv": the names are modules
        return {"/".join([*parts, n]) for n in names if (target / f"{n}.py").is_file()} or {"/".join(parts) + "/__init__"}
    return set()


def _kind(module: str) -> str:
    """'storage/' for a module in a folder, the module itself at the top."""
    return module.split("/")[0] + "/" if "/" in module else module


def test_each_folder_imports_only_what_stands_below_it():
    files = sorted(SERVER.rglob("*.py"))
    assert any(f.parent.name == "storage" for f in files), "server/storage/ is missing: update this test"
    wrong = []
    for f in files:
        me = _module(f)
        mine = _kind(me)
        for dep in _imports(f):
            theirs = _kind(dep)
            if theirs == mine:
                continue
            if mine in MAY_IMPORT and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{me} imports {dep}")
            if dep in WIRING and me not in WIRING:
                wrong.append(f"{me} imports the wiring ({dep})")
    assert wrong == []


def test_the_server_never_imports_the_client():
    for f in sorted(SERVER.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("deltasync.client") for n in names), f"{f} imports the client"


def test_the_reader_sees_relative_imports_across_folders():
    """The check above is only as good as _imports: it must see both spellings of an import across folders."""
    assert "storage/store" in _imports(SERVER / "parents" / "fetcher.py")
    assert "http/uploadrecv" in _imports(SERVER / "routes.py")
    assert "compat" in _imports(SERVER / "http" / "sendfile.py")
