-- Settle a finished request in one atomic step: give back (or charge) the difference between what it
-- reserved and what it used, add its usage counts (its totals, and its day's by API key and model), bring
-- its budgets' reservation down to its real cost, only while the tenant (this epoch of it) exists, and at
-- most once per request id (a retried settle whose first try did land is a no-op).
-- tenant_guard.lua, bucket_lib.lua and billing_lib.lua are prepended (see tenancy/layout.py).
--
-- KEYS[1]  the tenant's record (checked when ARGV[2] is "1"; see tenant_guard.lua)
-- KEYS[2]  the tenant's usage hash
-- KEYS[3]  the request's "settled" marker (used when ARGV[5] is not "")
-- KEYS[3+i]  bucket hashes (n), then KEYS[3+n+j] budget spend hashes (m), then KEYS[3+n+m+k] day-usage
--          hashes (r), then KEYS[#KEYS] the tenant's billing index (when m + r > 0)
-- ARGV[1]  now in ms, or "" for the Redis server's clock
-- ARGV[2]  "1": touch nothing unless the tenant record exists with epoch ARGV[3]; "0": no check
-- ARGV[4]  n, the number of buckets
-- ARGV[5]  lifetime of the marker KEYS[3], whole seconds; "" settles without a marker
-- ARGV[3*i+3], ARGV[3*i+4], ARGV[3*i+5]  rate_per_min, capacity, amount added to bucket i (a refund is
--          positive, an overrun charge negative; capped at capacity, floored at minus it)
-- then p and p usage field, amount pairs (HINCRBY; "cost" in picodollars, add_money)
-- then m and per budget: change of "used" (real cost - reserved; picodollars, may be negative), amount
--          added to "spent", soft limit ("" none), expiry of the spend hash (unix s)
-- then r and per day row: key id, model, requests, prompt_tokens, cached_tokens, completion_tokens, cost
--          (picodollars), expiry of the day's hash (unix s)
-- then the most fields a day's hash holds (a new key x model pair beyond it counts as '_other'), and the
--          gateway's unix s
--
-- Returns {1, level_1, ..., level_n, crossed_1, ..., crossed_m} (levels as strings; crossed_j is 1 when
-- this settle took budget j's spend to its soft limit, once per period), {-2} when the tenant is gone, or
-- {-3} when the marker says this request was settled already (nothing written in either case).

if ARGV[2] == '1' and not tenant_alive(KEYS[1], ARGV[3]) then
  return {-2}
end
if ARGV[5] ~= '' and not redis.call('SET', KEYS[3], '1', 'NX', 'EX', tonumber(ARGV[5])) then
  return {-3}
end

local n = tonumber(ARGV[4])
local out = {1}
if n > 0 then
  local now = now_ms(ARGV[1])
  for i = 1, n do
    local level = bucket_adjust(KEYS[3 + i], tonumber(ARGV[3 * i + 3]), tonumber(ARGV[3 * i + 4]), now,
      tonumber(ARGV[3 * i + 5]))
    out[1 + i] = string.format('%.17g', level)
  end
end
local at = 6 + 3 * n
local p = tonumber(ARGV[at])
for j = at + 1, at + 2 * p, 2 do
  if ARGV[j] == 'cost' then
    add_money(KEYS[2], 'cost', ARGV[j + 1])
  else
    redis.call('HINCRBY', KEYS[2], ARGV[j], ARGV[j + 1])
  end
end
at = at + 2 * p + 1
local m = tonumber(ARGV[at])
local r = tonumber(ARGV[at + 1 + 4 * m])
local max_fields = tonumber(ARGV[#ARGV - 1])
local now_s = ARGV[#ARGV]
for j = 1, m do
  local spend, base = KEYS[3 + n + j], at + 4 * (j - 1)
  local fresh = redis.call('EXISTS', spend) == 0  -- expired since its take: give it its expiry again
  redis.call('HINCRBY', spend, 'used', ARGV[base + 1])
  local spent = redis.call('HINCRBY', spend, 'spent', ARGV[base + 2])
  local soft = ARGV[base + 3]
  local crossed = 0
  if soft ~= '' and spent >= tonumber(soft) and redis.call('HSETNX', spend, 'soft', 1) == 1 then
    crossed = 1
  end
  out[#out + 1] = crossed
  if fresh then
    redis.call('EXPIREAT', spend, ARGV[base + 4])
    index_add(KEYS[#KEYS], spend, ARGV[base + 4], now_s)
  end
end
at = at + 1 + 4 * m
for k = 1, r do
  local day, base = KEYS[3 + n + m + k], at + 8 * (k - 1)
  local pair = ARGV[base + 1] .. ':' .. ARGV[base + 2]
  local fresh = redis.call('EXISTS', day) == 0  -- the day's first settle gives it its expiry and indexes it
  if not fresh and redis.call('HEXISTS', day, 'requests:' .. pair) == 0
      and redis.call('HLEN', day) >= max_fields then
    pair = '_other:_other'
  end
  for c, counter in ipairs({'requests', 'prompt_tokens', 'cached_tokens', 'completion_tokens'}) do
    if ARGV[base + 2 + c] ~= '0' then
      redis.call('HINCRBY', day, counter .. ':' .. pair, ARGV[base + 2 + c])
    end
  end
  if ARGV[base + 7] ~= '0' then
    add_money(day, 'cost:' .. pair, ARGV[base + 7])
  end
  if fresh then
    redis.call('EXPIREAT', day, ARGV[base + 8])
    index_add(KEYS[#KEYS], day, ARGV[base + 8], now_s)
  end
end
return out
