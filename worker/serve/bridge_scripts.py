"""The worker's server-side Lua scripts, each one atomic step on Redis where two commands from
the client would leave a gap another worker could fall into (``worker/serve/bridge.py`` runs them).
"""

# Take a consumer name (KEYS[1], the liveness key) unless another worker holds it, and publish this
# worker's WorkerInfo (KEYS[2]) in the same step, so a gateway that sees it alive also knows what
# it serves. ARGV: token, ttl (ms), info. Returns 1 when the name is ours.
TAKE_NAME = """
local held = redis.call('GET', KEYS[1])
if held == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif held ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
return 1
"""


# Heartbeat for the given entries that this consumer still holds (atomic: no claim can slip in
# between the check and the reset); returns those ids.
KEEP_HELD = """
local mine = {}
for _, e in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', #ARGV + 100000, ARGV[2])) do
  mine[e[1]] = true
end
local keep, claim = {}, {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  if mine[ARGV[i]] then
    keep[#keep + 1] = ARGV[i]
    claim[#claim + 1] = ARGV[i]
  end
end
if #keep > 0 then
  claim[#claim + 1] = 'JUSTID'
  redis.call(unpack(claim))
end
return keep
"""


# Move the entries of a worker's own stream onto the shared stream (delivered ones with their
# delivery count), in one atomic step, so no entry is served twice or lost. ARGV[2] "all": every
# entry, then the stream is deleted (its worker is dead or gone); "unread": only those never
# delivered (its worker is draining and still serves the others).
MOVE_ROUTED = """
local delivered = {}
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1000000)
if ok then
  for _, e in ipairs(pending) do delivered[e[1]] = e[4] end
end
local moved = 0
for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
  if ARGV[2] == 'all' or not delivered[e[1]] then
    local data = ''
    for i = 1, #e[2], 2 do
      if e[2][i] == 'data' then data = e[2][i + 1] end
    end
    redis.call('XADD', KEYS[2], '*', 'data', data, 'deliveries', delivered[e[1]] or 0)
    redis.call('XDEL', KEYS[1], e[1])
    moved = moved + 1
  end
end
if ARGV[2] == 'all' then redis.call('DEL', KEYS[1]) end
return moved
"""
