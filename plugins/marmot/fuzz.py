import asyncio, json, random
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState
from plugins.marmot.keys import ServerKey

class Sink:
    def __getattr__(self, n): return lambda *a: None

def rand_val(d=0):
    r = random.random()
    if d > 3 or r < 0.3: return random.choice([None, True, False, 0, -1, 1.5, "", "x", "EVENT", "abc"*3, 10**30, [], {}])
    if r < 0.6: return [rand_val(d+1) for _ in range(random.randint(0,4))]
    return {random.choice(["id","kind","sig","x"]): rand_val(d+1) for _ in range(random.randint(0,3))}

async def main():
    c = RelayClient("ws://x", ServerKey.generate(), Sink(), RelaySettings())
    c._sub_id = "s"
    for i in range(200000):
        kind = random.choice(["EVENT","EOSE","CLOSED","NOTICE","AUTH","OK","COUNT"])
        msg = [kind] + [random.choice(["s", rand_val()]) for _ in range(random.randint(0,4))]
        c.state = random.choice(list(RelayState))
        try:
            c._handle(json.dumps(msg).encode())
        except Exception as e:
            print("CRASH", msg, repr(e)); break
    print("tasks", len(c._side_tasks))
    for t in list(c._side_tasks): t.cancel()
asyncio.run(main())
