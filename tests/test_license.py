"""The LICENSE file people look for: the Apache License 2.0, whole, as pyproject.toml declares it."""

from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_license_is_apache_2_0_in_full() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    for n, title in enumerate(["Definitions", "Grant of Copyright License", "Grant of Patent License",
                               "Redistribution", "Submission of Contributions", "Trademarks",
                               "Disclaimer of Warranty", "Limitation of Liability",
                               "Accepting Warranty or Additional Liability"], start=1):
        assert f"   {n}. {title}." in text, title
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    # The text as the Apache Software Foundation publishes it (www.apache.org/licenses/LICENSE-2.0.txt).
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
