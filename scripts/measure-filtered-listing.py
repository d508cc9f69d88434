#!/usr/bin/env python3
"""What the name-filtered listing saves the broker: its CPU time for one listing of a vhost
holding N queues nobody governs plus two a policy names, read whole (the columns the findings
read) and as the filtered page queueguard reads there (README, "Where the counters come from").
The broker's CPU is utime + stime of the process listening on 5672 (/proc/<pid>/stat); each
way is read 20 times, twice, in mirrored order. Needs the local broker's management API on
15672 (guest/guest); makes and removes vhost qg-measure.

    scripts/measure-filtered-listing.py [N, default 5000]
"""
import urllib.request, base64, json, os, time, subprocess, urllib.parse, sys
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
base = "http://127.0.0.1:15672/api/"
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
def req(method, path, body=None):
    r = urllib.request.Request(base + path, method=method, data=None if body is None else json.dumps(body).encode(),
                               headers={"Authorization": auth, "content-type": "application/json"})
    with urllib.request.urlopen(r) as f:
        return f.read()
vh = "qg-measure"
req("PUT", f"vhosts/{vh}", {})
req("PUT", f"permissions/{vh}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
for i in range(N):
    req("PUT", f"queues/{vh}/other.{i}", {"durable": True})
for n in ["wanted.a", "wanted.b"]:
    req("PUT", f"queues/{vh}/{n}", {"durable": True})
time.sleep(6)
out = subprocess.run(["ss", "-ltnpH", "sport = :5672"], capture_output=True, text=True).stdout
pid = int(out.split("pid=")[1].split(",")[0])
tick = os.sysconf("SC_CLK_TCK")
def cpu():
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) * 1000 / tick
cols = "name,vhost,type,durable,auto_delete,exclusive,arguments,messages_ready,messages_unacknowledged,consumers,policy,idle_since,message_stats.ack,message_stats.redeliver"
name = urllib.parse.quote("^(?:wanted\\.a|wanted\\.b)$", safe="")
paths = {"whole": f"queues/{vh}?columns={cols}",
         "filtered": f"queues/{vh}?page=1&page_size=500&use_regex=true&name={name}&columns={cols}"}
R = 20
res = {"whole": 0.0, "filtered": 0.0}
for order in (["whole", "filtered"], ["filtered", "whole"]):
    for p in order:
        c0 = cpu()
        for _ in range(R):
            body = req("GET", paths[p])
        res[p] += cpu() - c0
        if p == "filtered":
            items = json.loads(body)["items"]
            assert sorted(q["name"] for q in items) == ["wanted.a", "wanted.b"], items
print(f"queues={N + 2} listings_each={2 * R} whole_cpu_ms_per_listing={res['whole'] / (2 * R):.1f} filtered_cpu_ms_per_listing={res['filtered'] / (2 * R):.1f} ratio={res['filtered'] / res['whole']:.3f}")
req("DELETE", f"vhosts/{vh}")
