-- Argo CD health check for tether.dev/WorkerRun, read from the kstatus-style conditions.
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
local phase = obj.status.phase or ""
if conds["Ready"] ~= nil and conds["Ready"].status == "True" then
  hs.status = "Healthy"
  hs.message = conds["Ready"].message or "Succeeded"
  return hs
end
if conds["Stalled"] ~= nil and conds["Stalled"].status == "True" then
  hs.status = "Degraded"
  hs.message = phase .. ": " .. (conds["Stalled"].message or "")
  return hs
end
if phase == "AwaitingApproval" or phase == "AwaitingReview" then
  hs.status = "Suspended"
  hs.message = "Awaiting " .. (phase == "AwaitingReview" and "review" or "approval") .. ": " ..
    ((conds["Approved"] ~= nil and conds["Approved"].message) or (phase == "AwaitingReview" and "gate Result" or "gate Start"))
  return hs
end
if phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = "spec.suspend is set"
  return hs
end
-- A paused worker keeps its lease, so its phase stays Running: the Suspended condition says it.
if conds["Suspended"] ~= nil and conds["Suspended"].status == "True" then
  hs.status = "Suspended"
  hs.message = "Paused: " .. (conds["Suspended"].message or "spec.suspend is set")
  return hs
end
-- A worker that waits for a person's decision on its request keeps its lease: Ready's reason says it.
if conds["Ready"] ~= nil and conds["Ready"].reason == "AwaitingApproval" then
  hs.status = "Suspended"
  hs.message = "Awaiting approval: " .. (conds["Ready"].message or "a worker's request")
  return hs
end
-- Queued through Kueue: waiting for its Workload's admission is progress, as for a queued Job.
if phase == "Queued" then
  hs.status = "Progressing"
  hs.message = "Queued: " .. ((conds["Admitted"] ~= nil and conds["Admitted"].message) or "waiting for Kueue")
  return hs
end
if conds["Admitted"] ~= nil and conds["Admitted"].status == "False" then
  hs.status = "Progressing"
  hs.message = "Waiting: " .. (conds["Admitted"].message or conds["Admitted"].reason)
  return hs
end
hs.status = "Progressing"
hs.message = phase .. ((conds["Reconciling"] ~= nil and conds["Reconciling"].message ~= nil)
                       and (": " .. conds["Reconciling"].message) or "")
return hs
