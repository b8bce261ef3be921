-- Several token buckets taken from (or adjusted) in one atomic step: all or nothing.
-- tenant_guard.lua and bucket_lib.lua are prepended (see tenancy/layout.py).
--
-- KEYS[1]  the tenant's record (checked when ARGV[3] is "1"; see tenant_guard.lua)
-- KEYS[1+i]  bucket hashes, fields: level (units), ts (ms), rate, cap (the terms of the last write)
-- ARGV[1]  now in ms, or "" to use the Redis server's clock (one clock for every gateway replica)
-- ARGV[2]  "take" (debit amount if every bucket holds it), "adjust" (add amount, may be negative) or
--          "lease" (as "take", after crediting credit_i; then also debit grant_i = min(extra_i,
--          floor(level left)) per bucket: a local lease, see policies/quota_lease.py)
-- ARGV[3]  "1": touch nothing unless the tenant record exists with epoch ARGV[4]; "0": no check
-- ARGV[3*i+2], ARGV[3*i+3], ARGV[3*i+4]  rate_per_min, capacity, amount of bucket i
-- ARGV[3*n+3+2*i], ARGV[3*n+4+2*i]  (mode "lease" only) extra_i, credit_i of bucket i: units to lease
--          beyond amount_i, and an earlier lease's units given back first (capped at the capacity;
--          written even when the take is refused)
--
-- ARGV[2] "budget": as "take", and first the request's budgets (tenancy/billing.py BudgetHold): KEYS[1+n+j]
--          the spend hash of budget j (field used: picodollars taken, in flight included), KEYS[#KEYS]
--          the tenant's billing index (billing_lib.lua); ARGV[#ARGV] = m, the number of budgets,
--          ARGV[#ARGV-1] the gateway's unix s, and before them per budget: hard limit (picodollars, ""
--          none), amount (the request's worst-case cost), expiry of the spend hash (unix s)
--
-- Buckets are checked in KEYS order (tenancy/quota.py puts a key's and a model's before the tenant's own).
--
-- Returns {status, wait_ms, limiting_index, level_1, ..., level_n[, grant_1, ..., grant_n]}
--   (grants in mode "lease" only, when status is 1)
--   status 1: done; 0: refused, retry after wait_ms (the slowest bucket's wait); limiting_index is the
--     first bucket short;
--   status -1: amount above capacity of bucket limiting_index (the first such), can never pass; nothing is
--     written (not even a credit), and the levels are the stored ones;
--   status -2: the tenant is gone (deleted, or re-created with another epoch): nothing written;
--   status -4: budget limiting_index would pass its hard limit: nothing written; {-4, 0, j, used_j}.
-- Levels are returned as strings (Lua numbers would be truncated to integers).

if ARGV[3] == '1' and not tenant_alive(KEYS[1], ARGV[4]) then
  return {-2, 0, 0}
end

local now = now_ms(ARGV[1])
local m = 0
if ARGV[2] == 'budget' then
  m = tonumber(ARGV[#ARGV])
end
local n = #KEYS - 1 - (m > 0 and m + 1 or 0)
local budget_base = #ARGV - 2 - 3 * m
for j = 1, m do -- a budget past its hard limit refuses first: it lasts until its period ends
  local hard = ARGV[budget_base + 3 * j - 2]
  local used = tonumber(redis.call('HGET', KEYS[1 + n + j], 'used') or '0')
  if hard ~= '' and used + tonumber(ARGV[budget_base + 3 * j - 1]) > tonumber(hard) then
    return {-4, 0, j, string.format('%.17g', used)}
  end
end
if ARGV[2] == 'adjust' then -- under each bucket's stored terms (bucket_adjust in bucket_lib.lua)
  local out = {1, 0, 0}
  for i = 1, n do
    local level = bucket_adjust(KEYS[1 + i], tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3]), now,
      tonumber(ARGV[3 * i + 4]))
    out[3 + i] = string.format('%.17g', level)
  end
  return out
end
local leasing = ARGV[2] == 'lease'
local rates, caps, amounts, levels, stamps, extras = {}, {}, {}, {}, {}, {}
local worst_wait, first_short, too_large = 0, 0, 0
local stored = {}  -- levels as stored (refilled), before any credit: what a refusal by size reports
local credited = false

for i = 1, n do
  local rate = tonumber(ARGV[3 * i + 2])
  local cap = tonumber(ARGV[3 * i + 3])
  local amount = tonumber(ARGV[3 * i + 4])
  rates[i], caps[i], amounts[i] = rate, cap, amount
  levels[i], stamps[i] = bucket_level(KEYS[1 + i], rate, cap, now)
  stored[i] = levels[i]
  if leasing then
    extras[i] = tonumber(ARGV[3 * n + 3 + 2 * i])
    local credit = tonumber(ARGV[3 * n + 4 + 2 * i])
    if credit ~= 0 then
      levels[i] = adjusted(levels[i], credit, cap)
      credited = true
    end
  end
  if amount > cap then
    if too_large == 0 then
      too_large = i
    end
  elseif levels[i] < amount then
    local wait = math.min(math.ceil((amount - levels[i]) * 60000 / rate), MAX_WAIT_MS)
    if first_short == 0 then
      first_short = i
    end
    if wait > worst_wait then
      worst_wait = wait
    end
  end
end

local out = {1, 0, 0}
if too_large > 0 then -- nothing written, not even a credit (the caller keeps its lease)
  out = {-1, 0, too_large}
  for i = 1, n do
    out[3 + i] = string.format('%.17g', stored[i])
  end
  return out
end
if worst_wait > 0 then
  out = {0, worst_wait, first_short}
  for i = 1, n do
    if credited then
      bucket_store(KEYS[1 + i], levels[i], stamps[i], rates[i], caps[i])
    end
    out[3 + i] = string.format('%.17g', levels[i])
  end
  return out
end

for i = 1, n do
  levels[i] = levels[i] - amounts[i]
  if leasing then
    local grant = math.max(0, math.min(extras[i], math.floor(levels[i])))
    levels[i] = levels[i] - grant
    out[3 + n + i] = grant
  end
  bucket_store(KEYS[1 + i], levels[i], stamps[i], rates[i], caps[i])
  out[3 + i] = string.format('%.17g', levels[i])
end
for j = 1, m do
  local spend, expire_at = KEYS[1 + n + j], ARGV[budget_base + 3 * j]
  local fresh = redis.call('EXISTS', spend) == 0  -- the period's first take: its expiry, the tenant's index
  redis.call('HINCRBY', spend, 'used', ARGV[budget_base + 3 * j - 1])
  if fresh then
    redis.call('EXPIREAT', spend, expire_at)
    index_add(KEYS[#KEYS], spend, expire_at, ARGV[#ARGV - 1])
  end
end
return out
