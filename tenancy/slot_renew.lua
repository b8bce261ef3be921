-- Renew the leases of slots this replica holds, in one call (see tenancy/concurrency.py).
-- bucket_lib.lua (for now_ms) is prepended (see tenancy/layout.py). No tenant guard: it only updates
-- members that exist (ZADD XX), so it never creates a set, and a deleted tenant's slots stay deleted.
--
-- KEYS[i]    the slot set of pair i (a set may appear more than once)
-- ARGV[1]    now in ms, or "" for the Redis server's clock
-- ARGV[2]    lease length, ms
-- ARGV[2+i]  the slot id of pair i
--
-- Returns {lease_end, i, ...}: the new lease end (a string, ms) and the indexes of the pairs whose slot
-- was no longer held (gone, or its lease ended: then it is removed, as an acquire would); those are lost
-- to their holder, which stops renewing them.

local now = now_ms(ARGV[1])
local lease_end = now + tonumber(ARGV[2])
local end_s = string.format('%.17g', lease_end)
local out = {end_s}
local touched = {}
for i = 1, #KEYS do
  local score = tonumber(redis.call('ZSCORE', KEYS[i], ARGV[2 + i]))
  if score and score > now then
    redis.call('ZADD', KEYS[i], 'XX', end_s, ARGV[2 + i])
    touched[KEYS[i]] = true
  else
    if score then
      redis.call('ZREM', KEYS[i], ARGV[2 + i])
    end
    out[#out + 1] = i
  end
end
for key in pairs(touched) do
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', key, math.max(1, math.ceil(tonumber(last[2]) - now)) + 1)
  end
end
return out
