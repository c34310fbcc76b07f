"""The tiers follow the folders (tests/conftest.py): a test whose markers say another tier
is refused at collection, naming the folder to move it to; a unit test that starts a
process fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import HERE, ProcessStarted, misplaced


def _item(folder: str, markers=(), fixtures=()):
    path = HERE / folder / "test_x.py" if folder else HERE / "test_x.py"
    names = set(markers)
    return SimpleNamespace(
        nodeid=f"{path.relative_to(HERE.parent).as_posix()}::test_y",
        path=path,
        fixturenames=list(fixtures),
        get_closest_marker=lambda name: name if name in names else None,
    )


@pytest.mark.parametrize(
    "folder,markers,fixtures",
    [
        ("unit", (), ()),
        ("distributed", (), ("pools",)),
        ("distributed", ("distributed",), ()),
        ("launcher", ("launcher", "slow"), ()),
    ],
)
def test_a_test_in_its_folder_passes(folder, markers, fixtures):
    assert misplaced(_item(folder, markers, fixtures)) is None


@pytest.mark.parametrize(
    "folder,markers,fixtures,move_to",
    [
        ("unit", ("launcher",), (), "tests/launcher/"),
        ("unit", (), ("pools",), "tests/distributed/"),
        ("distributed", (), (), "tests/unit/"),
        ("launcher", ("distributed",), (), "tests/distributed/"),
        ("", (), (), "tests/unit/"),
    ],
)
def test_a_test_in_another_folder_names_the_one_to_move_it_to(folder, markers, fixtures, move_to):
    why = misplaced(_item(folder, markers, fixtures))
    assert why is not None and why.endswith(f"move it to {move_to} (tests/README.md)"), why
    assert (f"tests/{folder}/" if folder else "no tier folder") in why


def test_the_folders_hold_only_tests_of_their_tier():
    tiers = {p.name for p in HERE.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    assert tiers == {"unit", "distributed", "launcher"}
    assert not list(HERE.glob("test_*.py"))  # none left at the top
    names = [p.name for t in sorted(tiers) for p in (HERE / t).glob("*.py")]
    assert all((HERE / t / "__init__.py").is_file() for t in tiers)  # equal names cannot clash
    assert len(names) > len(set(names))  # and some do repeat (split files)


def test_a_unit_test_that_starts_a_process_fails():
    with pytest.raises(ProcessStarted, match=r"mark the test @pytest\.mark\.distributed"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert Path(sys.executable).exists()
