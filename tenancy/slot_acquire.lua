-- Take one concurrency slot in every given slot set, or in none, atomically (see tenancy/concurrency.py).
-- tenant_guard.lua and bucket_lib.lua (for now_ms) are prepended (see tenancy/layout.py).
--
-- A slot set is a sorted set: member = a slot id, score = the end of the slot's lease (ms, Redis server
-- clock). A member whose lease has ended (score <= now) is no longer held: its holder died or stopped
-- renewing it, and it is removed here before the set is counted.
--
-- KEYS[1]    the tenant's record (checked when ARGV[2] is "1"; see tenant_guard.lua)
-- KEYS[1+i]  slot set i (the tenant's, the API key's: those with a cap)
-- ARGV[1]    now in ms, or "" for the Redis server's clock
-- ARGV[2]    "1": touch nothing unless the tenant record exists with epoch ARGV[3]; "0": no check
-- ARGV[4]    the slot id (unique per request)
-- ARGV[5]    lease length, ms
-- ARGV[5+i]  cap of slot set i: most members it may hold
--
-- Returns {1, lease_end} (lease_end as a string, ms) when the slot was added to every set;
--   {0, i, held} when set i already holds its cap (held = its live members; nothing added to any set);
--   {-2} when the tenant is gone (deleted, or re-created with another epoch): nothing written.

if ARGV[2] == '1' and not tenant_alive(KEYS[1], ARGV[3]) then
  return {-2}
end
local now = now_ms(ARGV[1])
local lease_end = now + tonumber(ARGV[5])
local now_s, end_s = string.format('%.17g', now), string.format('%.17g', lease_end)
for i = 2, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now_s)
  local held = redis.call('ZCARD', KEYS[i])
  if held >= tonumber(ARGV[4 + i]) then
    return {0, i - 1, held}
  end
end
for i = 2, #KEYS do
  redis.call('ZADD', KEYS[i], end_s, ARGV[4])
  -- the set lives as long as its longest lease (a replica with a longer lease setting may hold one)
  local last = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', KEYS[i], math.max(1, math.ceil(tonumber(last[2]) - now)) + 1)
end
return {1, end_s}
