-- Several token buckets taken from (or adjusted) in one atomic step: all or nothing.
-- Arithmetic mirrors policies/token_bucket.py (tested on one table); keep them in step.
--
-- KEYS[1]  the tenant's record (checked when ARGV[3] is "1"; see tenant_guard.lua, prepended)
-- KEYS[1+i]  bucket hashes, fields: level (units), ts (ms)
-- ARGV[1]  now in ms, or "" to use the Redis server's clock (one clock for every gateway replica)
-- ARGV[2]  "take" (debit amount if every bucket holds it) or "adjust" (add amount, may be negative)
-- ARGV[3]  "1": touch nothing unless the tenant record exists with epoch ARGV[4]; "0": no check
-- ARGV[3*i+2], ARGV[3*i+3], ARGV[3*i+4]  rate_per_min, capacity, amount of bucket i
--
-- Returns {status, wait_ms, limiting_index, level_1, ..., level_n}
--   status 1: done; 0: refused, retry after wait_ms (bucket limiting_index is the slowest);
--   status -1: amount above capacity of bucket limiting_index, can never pass;
--   status -2: the tenant is gone (deleted, or re-created with another epoch): nothing written.
-- Levels are returned as strings (Lua numbers would be truncated to integers).

if ARGV[3] == '1' and not tenant_alive(KEYS[1], ARGV[4]) then
  return {-2, 0, 0}
end

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local mode = ARGV[2]
local n = #KEYS - 1
local rates, caps, amounts, levels, stamps = {}, {}, {}, {}, {}
local worst_wait, worst_idx = 0, 0

for i = 1, n do
  local rate = tonumber(ARGV[3 * i + 2])
  local cap = tonumber(ARGV[3 * i + 3])
  local amount = tonumber(ARGV[3 * i + 4])
  rates[i], caps[i], amounts[i] = rate, cap, amount
  local stored = redis.call('HMGET', KEYS[1 + i], 'level', 'ts')
  local level, updated = tonumber(stored[1]), tonumber(stored[2])
  if level == nil or updated == nil then
    level, updated = cap, now
  end
  local elapsed = now - updated
  if elapsed > 0 then
    level = math.min(cap, level + elapsed * rate / 60000)
    updated = now
  end
  levels[i], stamps[i] = level, updated
  if mode == 'take' then
    if amount > cap then
      return {-1, 0, i}
    end
    if level < amount then
      local wait = math.ceil((amount - level) * 60000 / rate)
      if wait > worst_wait then
        worst_wait, worst_idx = wait, i
      end
    end
  end
end

local out = {1, 0, 0}
if mode == 'take' and worst_wait > 0 then
  out = {0, worst_wait, worst_idx}
  for i = 1, n do out[3 + i] = string.format('%.17g', levels[i]) end
  return out
end

for i = 1, n do
  if mode == 'take' then
    levels[i] = levels[i] - amounts[i]
  else
    levels[i] = math.max(-caps[i], math.min(caps[i], levels[i] + amounts[i]))
  end
  redis.call('HSET', KEYS[1 + i], 'level', string.format('%.17g', levels[i]), 'ts', string.format('%.17g', stamps[i]))
  -- An idle bucket refills from -capacity to full in 2*capacity/rate minutes; after that a missing key
  -- means the same as a full bucket, so the key can expire.
  redis.call('PEXPIRE', KEYS[1 + i], math.ceil(2 * caps[i] * 60000 / rates[i]) + 1000)
  out[3 + i] = string.format('%.17g', levels[i])
end
return out
