-- Token-bucket steps shared by token_bucket.lua and settle.lua (prepended to them; see tenancy/layout.py).
-- Arithmetic mirrors policies/token_bucket.py (tested on one table); keep them in step.
-- A bucket is a hash with fields level (units) and ts (ms); a missing one is full.

-- Longest wait and key lifetime, ms: policies/token_bucket.py MAX_WAIT_MS (1e13, written as digits by
-- Lua); a slower rate would overflow Redis's integers (PEXPIRE errors, an integer reply wraps).
local MAX_WAIT_MS = 10000000000000

-- now_ms(arg): arg as a number, or the Redis server's clock in ms when arg is "" (one clock for every
-- gateway replica).
local function now_ms(arg)
  local now = tonumber(arg)
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
  end
  return now
end

-- bucket_level(key, rate_per_min, capacity, now[, stored_terms]): the level refilled up to now (capped at
-- capacity; a clock going back refills nothing), the timestamp to store with it, and the rate and capacity
-- it was refilled with. With stored_terms (a settle or a give-back, which carry the quotas their request
-- was reserved under), the rate and capacity the bucket's last take wrote win over those given: a quota
-- lowered meanwhile is not refilled at the old rate nor up to the old burst. Last: true when the bucket
-- is missing (full); a refund to it writes nothing, as it may be full under a capacity larger than cap.
local function bucket_level(key, rate, cap, now, stored_terms)
  local stored = redis.call('HMGET', key, 'level', 'ts', 'rate', 'cap')
  local level, updated = tonumber(stored[1]), tonumber(stored[2])
  if stored_terms and tonumber(stored[3]) and tonumber(stored[4]) then
    rate, cap = tonumber(stored[3]), tonumber(stored[4])
  end
  local missing = level == nil or updated == nil
  if missing then
    level, updated = cap, now
  end
  local elapsed = now - updated
  if elapsed > 0 then
    level = math.min(cap, level + elapsed * rate / 60000)
    updated = now
  end
  return level, updated, rate, cap, missing
end

-- adjusted(level, amount, capacity): level + amount, capped at the capacity and floored at minus it.
local function adjusted(level, amount, cap)
  return math.max(-cap, math.min(cap, level + amount))
end

-- bucket_store(key, level, stamp, rate_per_min, capacity): write the bucket back, with the rate and
-- capacity it is under (read back by settles, see bucket_level).
-- An idle bucket refills from -capacity to full in 2*capacity/rate minutes; after that a missing key
-- means the same as a full bucket, so the key can expire.
local function bucket_store(key, level, stamp, rate, cap)
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'ts', string.format('%.17g', stamp),
    'rate', string.format('%.17g', rate), 'cap', string.format('%.17g', cap))
  redis.call('PEXPIRE', key, math.min(math.ceil(2 * cap * 60000 / rate), MAX_WAIT_MS) + 1000)
end

-- bucket_adjust(key, rate_per_min, capacity, now, amount): a settle's or an adjust's change to one bucket:
-- refilled under the bucket's stored terms (bucket_level), amount added (a refund > 0, an overrun charge
-- < 0; adjusted) and written back; a refund to a missing (full) bucket writes nothing. Returns the level.
local function bucket_adjust(key, rate, cap, now, amount)
  local level, stamp, missing
  level, stamp, rate, cap, missing = bucket_level(key, rate, cap, now, true)
  if missing and amount >= 0 then
    return level
  end
  level = adjusted(level, amount, cap)
  bucket_store(key, level, stamp, rate, cap)
  return level
end
