"""Documentation that must not drift from the code."""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config import ApnsAppConfig, FcmAppConfig, Settings
from gateway.testing import FcmSimulator, GatewayHarness, base_config, fcm_app_config

ROOT = Path(__file__).parents[1]


def _keys(model: type[BaseModel]) -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(field.alias or name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= _keys(annotation)
    return keys


def test_production_example_documents_every_core_and_app_key() -> None:
    text = (ROOT / "config" / "production.example.yaml").read_text()
    missing = set()
    for model in (Settings, ApnsAppConfig, FcmAppConfig):
        for key in _keys(model):
            if f"{key}:" not in text and f"{key}_file:" not in text:
                missing.add(key)
    assert not missing, f"config/production.example.yaml does not mention {sorted(missing)}"


def test_readme_shows_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make serve" in readme and "make test" in readme


# --- links ----------------------------------------------------------------------------

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE_BLOCK = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN_MD_PATH = re.compile(r"`([\w./-]+/[\w.-]+\.md)`")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_BLOCK.sub("", path.read_text())
    anchors = set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def _relative_links(path: Path) -> list[str]:
    text = _CODE_BLOCK.sub("", path.read_text())
    return [
        target
        for target in _LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_and_headings_that_exist(document: Path) -> None:
    broken = []
    for target in _relative_links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{document.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_named_as_paths_are_in_the_repository(document: Path) -> None:
    """`docs/receipts.md` in prose must exist too: specs kept elsewhere are named in words."""
    text = _CODE_BLOCK.sub("", document.read_text())
    missing = [
        name
        for name in _CODE_SPAN_MD_PATH.findall(text)
        if not (ROOT / name).exists() and not (document.parent / name).exists()
    ]
    assert not missing, f"{document.relative_to(ROOT)} names files not in the repository: {missing}"


def test_the_link_checker_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n[ok](page.md#title) [web](https://example.org/x.md) "
        "[gone](missing.md) [bad anchor](page.md#nope)\n\n```\n[in code](ignored.md)\n```\n"
    )
    assert _relative_links(page) == ["page.md#title", "missing.md", "page.md#nope"]
    assert _anchors(page) == {"title"}


# --- the plugin example and the testing helpers of docs/plugins.md ----------------------


def _python_block(document: Path, first_line: str) -> str:
    """The ```python block of `document` whose first line is `first_line`."""
    for block in re.findall(r"^```python\n(.*?)^```", document.read_text(), re.M | re.S):
        if block.startswith(first_line + "\n"):
            return str(block)
    raise AssertionError(f"{document.name}: no python block starting with {first_line!r}")


def _module(name: str, source: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`source` run as module `name`, in sys.modules for the test (as an import would be)."""
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def test_the_documented_testing_imports_work() -> None:
    import gateway.testing

    code = _python_block(ROOT / "docs" / "plugins.md", "from gateway.testing import (")
    namespace: dict[str, object] = {}
    exec(code, namespace)
    assert namespace["GatewayHarness"] is gateway.testing.harness.GatewayHarness
    for name in gateway.testing.__all__:
        assert getattr(gateway.testing, name) is not None


def test_gateway_testing_stays_light_to_import() -> None:
    """The pytest plugin imports the package: it must not load the whole gateway."""
    check = "import sys, gateway.testing; assert 'gateway.app' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


async def test_the_plugin_example_runs_and_answers_bad_bodies_with_400(
    tmp_path: Path, fcm_simulator: FcmSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin = _module(
        "myproto_doc_example",
        _python_block(ROOT / "docs" / "plugins.md", PLUGIN_EXAMPLE),
        monkeypatch,
    )
    config = base_config(
        tmp_path, {"myproto": {"apps": {"android": fcm_app_config(fcm_simulator, tmp_path)}}}
    )
    async with GatewayHarness(config, extra_plugins={"myproto": plugin}) as gw:
        response = await gw.client.post("/myproto/notify", json={"app": "android", "token": "t1"})
        assert response.status == 200
        assert await response.json() == {"ok": True}
        assert [r.token for r in fcm_simulator.requests] == ["t1"]
        bad_bodies = [
            b"not json",
            b"\xff\xfe",
            b"[1, 2]",
            b'{"app": "android"}',
            b'{"app": 1, "token": "t"}',
        ]
        for body in bad_bodies:
            response = await gw.client.post(
                "/myproto/notify", data=body, headers={"Content-Type": "application/json"}
            )
            assert response.status == 400, body
            answer = await response.json()
            assert answer["ok"] is False and answer["error"], body
    assert len(fcm_simulator.requests) == 1


async def test_the_documented_plugin_test_passes(
    tmp_path: Path, fcm_simulator: FcmSimulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/plugins.md's test of the example plugin, run against the example itself."""
    document = ROOT / "docs" / "plugins.md"
    package = _module("myproto_pushgw", "", monkeypatch)
    package.plugin = _module(  # type: ignore[attr-defined]
        "myproto_pushgw.plugin", _python_block(document, PLUGIN_EXAMPLE), monkeypatch
    )
    tests = _module(
        "test_myproto_doc", _python_block(document, "# tests/test_myproto.py"), monkeypatch
    )
    await tests.test_notify(tmp_path, fcm_simulator)


PLUGIN_EXAMPLE = "# myproto_pushgw/plugin.py"
