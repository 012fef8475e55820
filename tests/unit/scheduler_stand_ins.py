"""Stand-ins for the scheduler's live parts (servers, spawned workers), for tests that drive `Scheduler` directly."""


class StandInServers:
    """Stands in for `InferenceServers` (which needs live servers): one healthy server serving policy 0."""

    def __init__(self):
        self.load, self.version, self.failed = {"u": 0}, 0, []

    def model_name(self, version, default):
        return default

    def mark_failed(self, url, reason):
        self.failed.append(url)


class RecordingWorkers:
    """Stands in for `RolloutWorkers` (spawned processes): keeps the requests it is sent."""

    def __init__(self):
        self.requests = []

    async def submit(self, request):
        self.requests.append(request)


class PoolServers(StandInServers):
    """The one server is healthy and takes new groups (`least_loaded`)."""

    recovering = False

    def least_loaded(self):
        return "u"


class FourTasks:
    """A finite taskset of four tasks, each its index as data."""

    size = 4

    def __getitem__(self, idx):
        return {"i": idx}
