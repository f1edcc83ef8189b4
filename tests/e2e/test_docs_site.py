"""The docs site's generated and checked parts: the configuration reference lists every key of
the schema with a meaning, the README's mode table every precision mode, and every page is in
the site's navigation."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import yaml
from docs_blocks import REPO

from ampsweep.config import schema
from ampsweep.precision import modes


def _reference():
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "docs" / "hooks" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(cls: type, prefix: str) -> set[str]:
    out = set()
    obj = cls()
    for f in dataclasses.fields(cls):
        if f.name == "args":
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out |= _leaf_keys(type(value), f"{prefix}{f.name}.")
        else:
            out.add(prefix + {"target": "_target_", "partial": "_partial_"}.get(f.name, f.name))
    return out


def test_the_configuration_reference_lists_every_schema_key_with_its_meaning():
    page = _reference().render()
    rows = {}
    for line in page.splitlines():
        m = re.match(r"\| `([\w.]+)` \| (.+?) \| `(.*?)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    expected = set()
    for f in dataclasses.fields(schema.Schema):
        cls = schema.COMPONENTS.get(f.name) or type(f.default_factory())
        expected |= _leaf_keys(cls, f"{f.name}.")
    assert expected - set(rows) == set()
    assert "trainer.max_steps" in expected and "precision.scaler.init_scale" in expected
    without = sorted(k for k in expected if not rows[k][2].strip())
    assert without == [], f"give these schema fields a comment (the reference's meaning): {without}"
    assert rows["trainer.epochs"][:2] == ("int", "10")
    assert rows["trainer.device"][0] == "one of auto, cuda, cpu"
    assert rows["precision.scaler.init_scale"][1] == "65536.0"


def test_the_reference_lists_every_group_option():
    page = _reference().render()
    for path in (REPO / "conf").glob("*/*.yaml"):
        if path.parent.name != "hydra":
            assert f"`{path.parent.name}={path.stem}`" in page, path


def test_the_readme_is_a_front_door_with_every_mode():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert readme.split("```bash\n")[1].startswith("scripts/demo.sh ")  # the first command
    rows = set(re.findall(r"^\| `(\w+)`", readme, re.M))
    assert set(modes.NAMES) <= rows, set(modes.NAMES) - rows
    for image in re.findall(r"!\[[^]]*\]\(([^)]+)\)", readme):
        assert (REPO / image).is_file(), image


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text().replace("!!python", "#"))

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = set(pages(config["nav"]))
    on_disk = {
        str(p.relative_to(REPO / "docs"))
        for p in (REPO / "docs").rglob("*.md")
        if "hooks" not in p.parts
    }
    assert on_disk <= listed, on_disk - listed
    assert "reference/configuration.md" in listed  # generated, not on disk


def test_the_readmes_links_lead_somewhere():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len(links) > 10
    for link in links:
        if not link.startswith("http"):
            assert (REPO / link).exists(), link


def test_the_layout_counts_every_folders_modules():
    """docs/development.md says how many modules each folder of the package holds."""
    text = " ".join((REPO / "docs" / "development.md").read_text().split())
    said = text.split("Modules per folder, besides each `__init__.py`: ", 1)[1]
    said = said.split(" in all", 1)[0]
    package = REPO / "src" / "ampsweep"

    def modules(folder):
        return len([p for p in folder.glob("*.py") if p.name != "__init__.py"])

    folders = {
        p.parent.relative_to(package).name or "": p.parent for p in package.rglob("__init__.py")
    }
    counted = {name: int(n) for name, n in re.findall(r"(\w+) (\d+)", said)}
    assert re.search(r"`__main__.py` (\d+)", said)[1] == str(modules(package))
    assert {name: modules(folders[name]) for name in counted if name in folders} == {
        name: n for name, n in counted.items() if name in folders
    }
    assert set(folders) - {"", "conf"} <= set(counted), "a folder the page does not count"
    assert int(said.rsplit(" ", 1)[1]) == sum(modules(f) for f in folders.values())
