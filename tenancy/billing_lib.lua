-- Money and usage-by-day steps shared by token_bucket.lua and settle.lua (prepended; see tenancy/layout.py).
-- Money is whole picodollars (policies/pricing.py), added with HINCRBY: never a float sum.

-- A money counter never passes this many picodollars ($1M): above it, MONEY_CARRY is moved into the
-- field "carry:<field>" (units of $1M), so a lifetime total never overflows Redis's 64-bit integers
-- (one request costs at most 1e18 picodollars: the sum before the carry stays below 2e18).
local MONEY_CARRY = 1000000000000000000
local MONEY_CARRY_TEXT = '1000000000000000000'  -- as an argument (Lua would write the number 1e+18)

-- add_money(key, field, amount): add amount picodollars (a decimal string, >= 0) to a money counter.
local function add_money(key, field, amount)
  local total = redis.call('HINCRBY', key, field, amount)
  if total >= MONEY_CARRY then
    redis.call('HINCRBY', key, field, '-' .. MONEY_CARRY_TEXT)
    redis.call('HINCRBY', key, 'carry:' .. field, 1)
  end
end

-- index_add(index, key, expire_at): note key (a day's usage, a period's spend) in the tenant's billing
-- index, scored by when it expires (unix s), so tenant_delete.lua finds it; entries past now_s go, and the
-- index lives as long as its latest entry.
local function index_add(index, key, expire_at, now_s)
  redis.call('ZADD', index, expire_at, key)
  redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. now_s)
  local latest = redis.call('ZRANGE', index, -1, -1, 'WITHSCORES')
  redis.call('EXPIREAT', index, math.ceil(tonumber(latest[2])))
end
