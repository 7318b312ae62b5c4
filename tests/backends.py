"""A transition backend for core tests that need none: precision changes cost nothing and
upgrades never land on their own (``RuntimeCore``'s ``TransitionBackend``); it counts polls."""


class NullBackend:
    def __init__(self) -> None:
        self.polls = 0

    def downgrade(self, t) -> None:
        pass

    def start_upgrade(self, t) -> None:
        pass

    def abort_upgrade(self, t) -> None:
        pass

    def poll(self) -> None:
        self.polls += 1
