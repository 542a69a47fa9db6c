-- wrk script for bench/api_load.py: POST /v1/recommend, cycling through the bodies in a file (one
-- JSON body a line), and a JSON summary line at the end (latencies in microseconds).
--
--   wrk -t2 -c200 -d20s --timeout 10s --latency -s bench/api_load.lua http://127.0.0.1:PORT -- BODIES [THINK_MS]
--
-- With THINK_MS each connection waits that long after a response before its next request (wrk's
-- delay()); without it the loop is closed: the next request goes as soon as the response is read.

local requests = {}
local next_index = 0

function init(args)
   local path = args[1]
   if path == nil then
      error("give the bodies file after --")
   end
   for line in io.lines(path) do
      if #line > 0 then
         requests[#requests + 1] = wrk.format("POST", "/v1/recommend", {["Content-Type"] = "application/json"}, line)
      end
   end
   if #requests == 0 then
      error("no bodies in " .. path)
   end
   -- threads start at different bodies so the mix is even from the first request
   next_index = (id or 0) % #requests
   local think_ms = tonumber(args[2])
   if think_ms ~= nil and think_ms > 0 then
      delay = function() return think_ms end
   end
end

local thread_id = 0
function setup(thread)
   thread:set("id", thread_id)
   thread_id = thread_id + 1
end

function request()
   next_index = next_index % #requests + 1
   return requests[next_index]
end

function done(summary, latency, _)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, "errors": {"connect": %d, "read": %d, '
      .. '"write": %d, "status": %d, "timeout": %d}, "latency_us": {"p50": %d, "p90": %d, "p99": %d, '
      .. '"p99_9": %d, "max": %d, "mean": %.1f}}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
      latency.max, latency.mean))
end
