-- Argo CD health check for tether.dev/WorkerRunSchedule, read from its conditions.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Tether operator"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
   and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local conds = {}
for _, c in ipairs(obj.status.conditions) do
  conds[c.type] = c
end
if conds["Stalled"] ~= nil and conds["Stalled"].status == "True" then
  hs.status = "Degraded"
  hs.message = conds["Stalled"].message or "the schedule does not parse"
  return hs
end
if conds["Degraded"] ~= nil and conds["Degraded"].status == "True" then
  hs.status = "Degraded"
  hs.message = "Last run failed: " .. (conds["Degraded"].message or "")
  return hs
end
if conds["Ready"] ~= nil and conds["Ready"].reason == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is set"
  return hs
end
hs.status = "Healthy"
hs.message = (conds["Ready"] ~= nil and conds["Ready"].message) or "Scheduled"
return hs
