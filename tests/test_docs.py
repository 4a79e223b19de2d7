"""Documentation that must not drift from the code."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from gateway.config import ApnsAppConfig, FcmAppConfig, Settings

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
