-- Tenant guard, prepended to scripts that write a tenant's buckets or usage (see tenancy/layout.py).
-- tenant_alive(record_key, epoch): the tenant record exists and its "epoch" field equals epoch
-- (a record written before epochs existed has none, which equals the empty epoch).
local function tenant_alive(record_key, epoch)
  local raw = redis.call('GET', record_key)
  if not raw then
    return false
  end
  local ok, record = pcall(cjson.decode, raw)
  local stored = ''
  if ok and type(record) == 'table' and type(record['epoch']) == 'string' then
    stored = record['epoch']
  end
  return stored == epoch
end
