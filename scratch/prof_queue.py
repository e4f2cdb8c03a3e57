import cProfile, io, pstats, sys, time, random
from redis import Redis
from producer.client import Client
from bench.noop import NoopEngine
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

r = Redis.from_url("redis://127.0.0.1:6390/0")
r.flushdb()
client = Client(redis=r)
rng = random.Random(1)
W = "loan income debt ratio history clean late payments amount requested".split()
jobs = [{"custom_id": f"q{i}", "model": "laya", "prompt": " ".join(rng.choice(W) for _ in range(200)),
         "escalate": False} for i in range(2048)]
handle = client.submit_batch(jobs)
noop = NoopEngine()
w = BatchWorker(r, noop, noop.config, WorkerSettings(burst=True, name="noop"))
pr = cProfile.Profile()
t = time.perf_counter()
pr.enable()
w.work()
pr.disable()
el = time.perf_counter() - t
print(f"{len(jobs)/el:.0f} jobs/s, {el/ (len(jobs)/256)*1000:.1f} ms per 256-take")
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats(sys.argv[1] if len(sys.argv) > 1 else "cumulative").print_stats(45)
print(s.getvalue())
r.flushdb()
