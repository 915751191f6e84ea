"""Silences the one notice the pinned model libraries repeat on every trace."""

from __future__ import annotations

import functools
import logging


class _DropFlaxDeprecation(logging.Filter):
    """diffusers and transformers log that their Flax classes are deprecated each time a
    Flax module is imported or set up; the versions are pinned on purpose (see
    docs/getting-started.md, "Dependencies")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "classes are deprecated" not in record.getMessage()


@functools.cache
def quiet_flax_deprecation_notices() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        for handler in library.get_logger().handlers:
            handler.addFilter(_DropFlaxDeprecation())
