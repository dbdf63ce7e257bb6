"""The ground floor every package may import (models/ and data_pipeline/ import nothing else of framework/): the
error types, logging, file locks, the YAML-to-dataclass loader and the run-directory format. It imports nothing of
the project outside itself."""
