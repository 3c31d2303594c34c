"""The canonical config's sections, one dataclass per owner; fivefold.config.schema joins them into `Config`."""
