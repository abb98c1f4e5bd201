-- Argo CD health check for kascade.io/ModelService (resource.customizations.health.kascade.io_ModelService).
-- Follows the kstatus conditions the operator writes: Stalled=True -> Degraded (it cannot progress
-- without a change: invalid or forbidden spec, no GPU for the pods it needs); Reconciling=True or a
-- status older than the spec -> Progressing; Ready=True -> Healthy.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Kascade operator"
  return hs
end
if obj.metadata ~= nil and obj.metadata.generation ~= nil and obj.status.observedGeneration ~= obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(obj.metadata.generation)
  return hs
end
local byType = {}
for _, c in ipairs(obj.status.conditions) do
  byType[c.type] = c
end
local function msg(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason or ""
end
if byType["Stalled"] ~= nil and byType["Stalled"].status == "True" then
  hs.status = "Degraded"
  hs.message = msg(byType["Stalled"])
  return hs
end
if byType["Reconciling"] ~= nil and byType["Reconciling"].status == "True" then
  hs.status = "Progressing"
  hs.message = msg(byType["Reconciling"])
  return hs
end
if byType["Ready"] ~= nil and byType["Ready"].status == "True" then
  hs.status = "Healthy"
  hs.message = msg(byType["Ready"])
  return hs
end
hs.status = "Progressing"
hs.message = "Not ready yet"
return hs
